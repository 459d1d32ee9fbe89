"""A per-model channel transform (KLT) the ``cachegen`` codec can code in, and its stored entry.

Per (K/V, layer, KV head) an orthonormal basis: the principal directions of the model's keys or
values on calibration text (:mod:`ragkv.codec.calibrate` measures it). Coding in that basis
lets one step per head serve channels of very different spread (the decorrelated components
carry most of the variance in a few directions). Keys are first rotated back to position 0 with
the RoPE pair frequencies the entry carries: RoPE turns each channel pair at its own rate, which
hides the channels' correlation from a fixed basis (issue 15: the post-RoPE KLT saved nothing,
the pre-RoPE one 3-12%). The whole transform is orthonormal per token, so it preserves norms and
needs no exact match with the model's own rotary module to be correct: only to pay.

The entry is a ragkv bitstream (codec name ``channel-transform``): checksummed, bound to its
storage key and to the model fingerprint in its header. :func:`load_transform` returns None for
one written for another model, under another key, damaged, or malformed: a miss, never a wrong
basis. A chunk coded in a transform names its digest in its header, and decodes only with it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
import torch

from ragkv.codec.bitstream import FORMAT_VERSION, open_frame, pack
from ragkv.codec.header import AUTH_HMAC_SHA256, BitstreamHeader
from ragkv.codec.trust import check_secret, mac_key
from ragkv.digests import sha256_hex
from ragkv.errors import CodecError, IncompatibleCacheError
from ragkv.types import StorageKey, tenant_namespace

__all__ = [
    "ChannelTransform",
    "TRANSFORM_CODEC",
    "TransformDigest",
    "load_transform",
    "transform_blob",
    "transform_key",
]

log = logging.getLogger(__name__)

TransformDigest = NewType("TransformDigest", str)  # sha256 hex of a transform's canonical bytes
TRANSFORM_CODEC = "channel-transform"  # the codec name in a stored transform's header
_ORTHO_TOLERANCE = 1e-3  # max |B^T B - I| of a stored basis (float32 eigenvectors are ~1e-6 off)


@dataclass(frozen=True, slots=True)
class ChannelTransform:
    """One model's channel transform: a basis per (K/V, layer, head), used where ``enabled`` says.

    Shapes follow the model's KV: ``[layers, kv_heads, tokens, head_dim]``.
    """

    model_fingerprint: str  # the model whose KV it was calibrated on (and may only be used for)
    basis: torch.Tensor  # [2, L, H, D, D] float32; columns: principal directions, variance descending
    enabled: tuple[tuple[bool, ...], tuple[bool, ...]]  # [K/V][layer]: code this layer in the basis
    inv_freq: tuple[float, ...] = ()  # RoPE pair frequencies keys are rotated back by (empty: none)
    # [K/V][layer] multipliers of a level's steps, from the model's measured per-layer sensitivity
    # (see calibrate.step_scales); empty: 1 everywhere. Only the encoder reads them.
    step_scales: tuple[tuple[float, ...], ...] = ()
    digest: TransformDigest = field(init=False)  # sha256 of the fields above, canonical bytes

    def __post_init__(self) -> None:
        basis = self.basis.detach().to("cpu", torch.float32).contiguous()
        if basis.dim() != 5 or basis.shape[0] != 2 or basis.shape[3] != basis.shape[4]:
            raise ValueError(f"basis must be [2, layers, heads, head_dim, head_dim]; got {tuple(basis.shape)}")
        layers, head_dim = basis.shape[1], basis.shape[3]
        if len(self.enabled) != 2 or any(len(flags) != layers for flags in self.enabled):
            raise ValueError(f"enabled must hold two tuples of {layers} flags (keys, values)")
        if 2 * len(self.inv_freq) > head_dim or not all(math.isfinite(f) for f in self.inv_freq):
            raise ValueError(f"inv_freq must hold at most {head_dim // 2} finite frequencies")
        if not bool(torch.isfinite(basis).all()):
            raise ValueError("basis holds NaN or infinite values")
        if self.step_scales and (
            len(self.step_scales) != 2
            or any(
                len(row) != layers or not all(0 < v < 1e3 and math.isfinite(v) for v in row) for row in self.step_scales
            )
        ):
            raise ValueError(f"step_scales must be empty or two rows of {layers} positive multipliers")
        object.__setattr__(self, "basis", basis)
        object.__setattr__(self, "enabled", tuple(tuple(bool(f) for f in flags) for flags in self.enabled))
        object.__setattr__(self, "inv_freq", tuple(float(f) for f in self.inv_freq))
        object.__setattr__(self, "step_scales", tuple(tuple(float(v) for v in row) for row in self.step_scales))
        object.__setattr__(self, "digest", TransformDigest(hashlib.sha256(self._canonical()).hexdigest()))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` the transform applies to."""
        _, layers, heads, head_dim, _ = self.basis.shape
        return (layers, heads, head_dim)

    def _canonical(self) -> bytes:
        flags = bytes(int(f) for flags in self.enabled for f in flags)
        head = struct.pack("<4I", *self.shape, len(self.inv_freq))
        return b"\0".join(
            [
                self.model_fingerprint.encode(),
                head,
                np.asarray(self.inv_freq, dtype="<f8").tobytes(),
                flags,
                np.asarray(self.step_scales, dtype="<f8").tobytes(),
                self.basis.numpy().astype("<f4").tobytes(),
            ]
        )

    def scales(self, kind: int) -> torch.Tensor:
        """Step multipliers ``[L]`` for keys (``kind`` 0) or values (1)."""
        if not self.step_scales:
            return torch.ones(self.shape[0])
        return torch.tensor(self.step_scales[kind], dtype=torch.float32)

    def forward(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[L, H, T, D]`` in the transform's space (fp32; layers not enabled pass through)."""
        keys = _apply(self._rope(keys, positions, inverse=True), self.basis[0], self.enabled[0], transpose=False)
        return keys, _apply(values.float(), self.basis[1], self.enabled[1], transpose=False)

    def inverse(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`forward` (fp32, on the tensors' device)."""
        keys = self._rope(
            _apply(keys.float(), self.basis[0], self.enabled[0], transpose=True), positions, inverse=False
        )
        return keys, _apply(values.float(), self.basis[1], self.enabled[1], transpose=True)

    def _rope(self, keys: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        """Keys of enabled layers rotated by ``-angle`` (``inverse``) or ``+angle`` at ``positions``.

        Half-split pairs ``(i, i + r)`` over the first ``2r`` dims, ``r = len(inv_freq)``, as
        transformers' ``rotate_half`` pairs them; angles in fp64 so far positions stay exact.
        """
        keys = keys.float()
        on = [i for i, f in enumerate(self.enabled[0]) if f]
        if not self.inv_freq or not on:
            return keys
        r = len(self.inv_freq)
        freq = torch.tensor(self.inv_freq, dtype=torch.float64)
        angle = positions.to("cpu", torch.float64).view(-1, 1) * freq.view(1, -1)  # [T, r]
        cos = angle.cos().float().to(keys.device)
        sin = (-angle.sin() if inverse else angle.sin()).float().to(keys.device)
        out = keys.clone()
        x1, x2 = keys[on, :, :, :r], keys[on, :, :, r : 2 * r]  # [L_on, H, T, r]
        out[on, :, :, :r] = x1 * cos - x2 * sin
        out[on, :, :, r : 2 * r] = x2 * cos + x1 * sin
        return out


def _apply(x: torch.Tensor, basis: torch.Tensor, enabled: Sequence[bool], transpose: bool) -> torch.Tensor:
    """``x`` ``[L, H, T, D]`` times each enabled layer's basis ``[L, H, D, D]`` (or its transpose)."""
    on = [i for i, f in enumerate(enabled) if f]
    if not on:
        return x
    b = basis[on].to(x.device)
    out = x.clone()
    out[on] = x[on] @ (b.transpose(2, 3) if transpose else b)
    return out


def transform_key(tenant: str, model_fingerprint: str) -> StorageKey:
    """The storage key of ``model_fingerprint``'s transform in ``tenant``'s namespace (one per model and format)."""
    digest = sha256_hex(
        b"\0".join([TRANSFORM_CODEC.encode(), model_fingerprint.encode(), str(FORMAT_VERSION).encode()])
    )
    return StorageKey(f"{tenant_namespace(tenant)}/{digest}")


def transform_blob(transform: ChannelTransform, *, key: StorageKey, secret: bytes | None = None) -> bytes:
    """``transform`` as a stored entry: a checksummed bitstream bound to ``key`` and its model."""
    check_secret(secret)
    layers, heads, head_dim = transform.shape
    section = transform.basis.numpy().astype("<f4").tobytes()
    header = BitstreamHeader(
        format_version=FORMAT_VERSION,
        codec=TRANSFORM_CODEC,
        level=0,
        num_layers=layers,
        num_kv_heads=heads,
        num_tokens=0,
        head_dim=head_dim,
        source_dtype="float32",
        model_fingerprint=transform.model_fingerprint,
        position_runs=(),
        section_sizes=(len(section),),
        params={
            "enabled": [[int(f) for f in flags] for flags in transform.enabled],
            "inv_freq": list(transform.inv_freq),
            "step_scales": [list(row) for row in transform.step_scales],
        },
        storage_key=key,
        auth=AUTH_HMAC_SHA256 if secret is not None else "",
    )
    return pack(header, [section], mac_key=None if secret is None else mac_key(secret, key))


def load_transform(
    data: bytes | bytearray | memoryview, *, key: StorageKey, model_fingerprint: str, secret: bytes | None = None
) -> ChannelTransform | None:
    """The transform stored in ``data``, or None (logged) if it is not a sound one for this key and model.

    None for: another model's fingerprint, another key, damage (checksums), a missing or wrong
    tag when ``secret`` is given, a newer format, or fields that do not make an orthonormal basis.
    The caller treats None as a miss (recalibrate, or code without the transform).
    """
    try:
        return _load(data, key, model_fingerprint, secret)
    except (CodecError, IncompatibleCacheError, ValueError) as e:
        log.warning("channel transform entry %s refused (a miss): %s", key, e)
        return None


def _load(
    data: bytes | bytearray | memoryview, key: StorageKey, fingerprint: str, secret: bytes | None
) -> ChannelTransform:
    frame = open_frame(data)
    header = frame.header
    if header.codec != TRANSFORM_CODEC:
        raise CodecError(f"entry holds codec {header.codec!r}, not a channel transform")
    if header.storage_key != key:
        raise IncompatibleCacheError(f"entry was written for key {header.storage_key!r}")
    if header.model_fingerprint != fingerprint:
        raise IncompatibleCacheError(f"entry is for model {header.model_fingerprint!r}, not {fingerprint!r}")
    layers, heads, _, head_dim = header.shape
    if header.section_sizes != (2 * layers * heads * head_dim * head_dim * 4,):
        raise CodecError("channel transform section does not hold its basis")
    if secret is not None:
        frame.verify_tag(mac_key(secret, key))
    frame.verify_checksum()
    enabled, inv_freq, scales = (header.params.get(name) for name in ("enabled", "inv_freq", "step_scales"))
    if not (
        isinstance(enabled, list)
        and len(enabled) == 2
        and all(isinstance(f, list) and all(v in (0, 1) and not isinstance(v, bool) for v in f) for f in enabled)
        and isinstance(inv_freq, list)
        and all(isinstance(v, float | int) and not isinstance(v, bool) for v in inv_freq)
        and isinstance(scales, list)
        and all(
            isinstance(r, list) and all(isinstance(v, float | int) and not isinstance(v, bool) for v in r)
            for r in scales
        )
    ):
        raise CodecError("channel transform parameters are malformed")
    section = frame.sections()[0]
    basis = torch.from_numpy(np.frombuffer(section, dtype="<f4").copy()).view(2, layers, heads, head_dim, head_dim)
    gram = basis.transpose(3, 4) @ basis
    if not bool(torch.isfinite(basis).all()) or float((gram - torch.eye(head_dim)).abs().max()) > _ORTHO_TOLERANCE:
        raise CodecError("channel transform basis is not orthonormal")
    return ChannelTransform(
        fingerprint, basis, (tuple(enabled[0]), tuple(enabled[1])), tuple(inv_freq), tuple(tuple(r) for r in scales)
    )
