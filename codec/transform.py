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
from typing import Any, NewType

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
        """Keys and values ``[L, H, T, D]`` in the transform's space: new fp32 tensors (layers
        not enabled pass through)."""
        k, v = keys.to(torch.float32, copy=True), values.to(torch.float32, copy=True)
        self._rope_(k, positions, inverse=True)
        _apply_(k, self.basis[0], self.enabled[0], transpose=False)
        _apply_(v, self.basis[1], self.enabled[1], transpose=False)
        return k, v

    def inverse(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`forward`: new fp32 tensors on the inputs' device."""
        k, v = keys.to(torch.float32, copy=True), values.to(torch.float32, copy=True)
        self.inverse_(k, v, positions)
        return k, v

    def inverse_(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """:meth:`inverse` in place, on fp32 tensors (the decoder's own output: no copy)."""
        if keys.dtype != torch.float32 or values.dtype != torch.float32:
            raise TypeError("inverse_ works on float32 tensors; use inverse() for others")
        _apply_(keys, self.basis[0], self.enabled[0], transpose=True)
        self._rope_(keys, positions, inverse=False)
        _apply_(values, self.basis[1], self.enabled[1], transpose=True)

    def _rope_(self, keys: torch.Tensor, positions: torch.Tensor, inverse: bool) -> None:
        """Rotate fp32 keys of enabled layers in place by ``-angle`` (``inverse``) or ``+angle`` at ``positions``.

        Half-split pairs ``(i, i + r)`` over the first ``2r`` dims, ``r = len(inv_freq)``, as
        transformers' ``rotate_half`` pairs them; angles in fp64 so far positions stay exact.
        Runs of enabled layers are slices (views): fancy indexing copied the keys twice over.
        """
        if not self.inv_freq:
            return
        r = len(self.inv_freq)
        freq = torch.tensor(self.inv_freq, dtype=torch.float64)
        angle = positions.to("cpu", torch.float64).view(-1, 1) * freq.view(1, -1)  # [T, r]
        cos, sin = _like(angle.cos().float(), keys), _like((-angle.sin() if inverse else angle.sin()).float(), keys)
        x = _host_view(keys)
        for a, b in _runs(self.enabled[0]):
            x1, x2 = x[a:b, :, :, :r], x[a:b, :, :, r : 2 * r]  # views [n, H, T, r]
            rotated = x1 * cos
            rotated -= x2 * sin
            x2 *= cos
            x2 += x1 * sin
            x1[...] = rotated


def _host_view(x: torch.Tensor) -> Any:
    """``x`` as a numpy view on the CPU (numpy's single-threaded loops: torch's OpenMP ones stalled
    10-100x on barriers on a busy 2-core machine, see ``_quant``), else ``x`` itself."""
    return x.numpy() if x.device.type == "cpu" else x


def _like(t: torch.Tensor, x: torch.Tensor) -> Any:
    """CPU tensor ``t`` as what :func:`_host_view` gives for ``x`` (numpy, or a tensor on ``x``'s device)."""
    return t.numpy() if x.device.type == "cpu" else t.to(x.device)


def _runs(enabled: Sequence[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in ``enabled``.

    >>> _runs([True, True, False, True])
    [(0, 2), (3, 4)]
    """
    out: list[tuple[int, int]] = []
    for i, flag in enumerate(enabled):
        if flag and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif flag:
            out.append((i, i + 1))
    return out


def _apply_(x: torch.Tensor, basis: torch.Tensor, enabled: Sequence[bool], transpose: bool) -> None:
    """``x`` ``[L, H, T, D]`` (fp32) times each enabled layer's basis ``[L, H, D, D]`` (or its transpose), in place."""
    view = _host_view(x)
    head_dim = x.shape[-1]
    # On the CPU, blocks of tokens small enough that OpenBLAS runs each product on one thread
    # (it threads above m*n*k = 4 * 65536): its threads spun against torch's idle OpenMP ones
    # on 2 busy cores and decoded at 30-75 MB/s instead of 600+ (experiments/codec_decode_speed.py).
    block = max(1, (4 * 65536 - 1) // (head_dim * head_dim)) if x.device.type == "cpu" else x.shape[2]
    for a, b in _runs(enabled):
        m = _like((basis[a:b].transpose(2, 3) if transpose else basis[a:b]).contiguous(), x)
        for t in range(0, x.shape[2], block):
            part = view[a:b, :, t : t + block]
            part[...] = part @ m


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
