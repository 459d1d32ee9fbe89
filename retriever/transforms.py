"""The model's channel transform on the index and query paths: which chunk caches use it, and where it comes from.

One transform per model fingerprint and tenant (:mod:`ragkv.codec.transform`), stored as an entry of
its own under ``transform_key``. A process reads it from the store once and keeps it; when the store
has none (or a damaged, foreign or unauthenticated one: ``load_transform`` refuses it), it is
calibrated from the first chunks at hand (a prefill of about ``calibration_tokens`` tokens), stored,
and used from then on. Chunk keys digest the transform, so a chunk coded in another transform is
never looked up: a lost transform only turns the chunks coded in it into misses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragkv.codec import cachegen, get_codec
from ragkv.codec.base import Codec
from ragkv.codec.calibrate import calibrate, step_scales
from ragkv.codec.transform import ChannelTransform, load_transform, transform_blob, transform_key
from ragkv.types import ChunkKV, CodecSpec, StorageKey

if TYPE_CHECKING:
    from ragkv.cache.store import TieredStore
    from ragkv.model import ModelAdapter

logger = logging.getLogger(__name__)

__all__ = ["TransformConfig", "TransformSource", "UNCALIBRATED", "rope_frequencies"]

# the transform digest of keys asked for before any transform exists: no blob is ever stored under
# it (``ChunkComputer.put`` never encodes under it), so such keys miss
UNCALIBRATED = "uncalibrated"
_KEEP = 1e15  # the transform entry's cost hint for cost-aware eviction (chunks give their token count)


@dataclass(frozen=True, slots=True)
class TransformConfig:
    """Whether and how stored chunk caches are coded in the model's channel transform.

    On by default at ``cachegen`` levels 1 and 2: on held-out text the transform as indexing
    calibrates it stores 7-12% fewer bytes per level, 9% and 4% fewer there than plain levels at
    equal KL; level 3's KL moved with the calibration text (up to 1.7x plain's), and level 0 (the
    default codec, chosen for its KL) rose a little. Sensitivity steps are off: measured without
    a question they helped level 1 and hurt level 2 (docs/configuration.md, docs/benchmarks.md).
    """

    levels: tuple[int, ...] = (1, 2)  # levels of a codec that can use a transform coded in it; (): never
    calibration_tokens: int = 2048  # chunk tokens prefilled to calibrate the transform (once per model)
    sensitivity: bool = False  # scale each layer's steps by its measured sensitivity (2 x layers 32-token passes)

    def __post_init__(self) -> None:
        if not isinstance(self.levels, tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.levels
        ):
            raise ValueError(f"levels must be a tuple of codec levels >= 0, () for never; got {self.levels!r}")
        if isinstance(self.calibration_tokens, bool) or not isinstance(self.calibration_tokens, int):
            raise TypeError(f"calibration_tokens must be an int; got {self.calibration_tokens!r}")
        if self.calibration_tokens < 16:
            raise ValueError(f"calibration_tokens must be >= 16; got {self.calibration_tokens}")

    def applies(self, spec: CodecSpec) -> bool:
        """Whether chunks stored at ``spec`` are coded in the transform."""
        if spec.level not in self.levels:
            return False
        return type(get_codec(spec.name)).encode_transformed is not Codec.encode_transformed


def rope_frequencies(adapter: ModelAdapter) -> tuple[float, ...]:
    """The model's RoPE pair frequencies, read off its own rotary module at position 1 (empty: none)."""
    rotary = getattr(adapter, "rotary", None)
    if rotary is None:
        return ()
    cos, sin = rotary(torch.tensor([1]))  # [1, 1, rot_dim] each
    r = cos.shape[-1] // 2
    return tuple(float(a) for a in torch.atan2(sin[0, 0, :r].double().cpu(), cos[0, 0, :r].double().cpu()))


class TransformSource:
    """One model's channel transform for one tenant: read from the store once, or calibrated and stored.

    Args:
        adapter: the model (its fingerprint binds the entry; calibration prefills with it).
        store: where the entry lives, beside the chunk caches.
        tenant: namespace of the entry's key.
        config: calibration settings.
        store_secret: MAC key material the entry is signed with (None: unauthenticated).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        store: TieredStore,
        *,
        tenant: str,
        config: TransformConfig,
        store_secret: bytes | None = None,
    ) -> None:
        self.adapter, self.store, self.config = adapter, store, config
        self.store_secret = store_secret
        self.tenant = tenant
        self._transform: ChannelTransform | None = None
        self._looked = False  # the store was read (a miss is remembered too: no store read per chunk key)
        # reloads one at a time: two threads reading at once (the vLLM connector's scheduler and its
        # loader) could otherwise leave the older read in place after the newer
        self._reload_lock = threading.Lock()

    @property
    def key(self) -> StorageKey:
        """Where the entry is stored (made on first use: the model's fingerprint may be computed lazily)."""
        return transform_key(self.tenant, self.adapter.fingerprint)

    def current(self) -> ChannelTransform | None:
        """The transform this process uses: the stored one, read once (None: none usable yet)."""
        if not self._looked:
            self._looked = True
            self._transform = self._read()
        return self._transform

    def reload(self) -> ChannelTransform | None:
        """Read the store's entry again (another process may have calibrated or replaced it since) and use it.

        For readers that never calibrate (the vLLM connector). Until the read returns, other threads
        keep the transform read before; reloads run one at a time, so the last to start wins.
        """
        with self._reload_lock:
            self._transform, self._looked = self._read(), True
            return self._transform

    def digest(self) -> str:
        """The current transform's digest, or :data:`UNCALIBRATED` (keys that always miss)."""
        current = self.current()
        return UNCALIBRATED if current is None else current.digest

    def find(self, digest: str) -> ChannelTransform | None:
        """The transform with ``digest`` (a key's), to encode or decode with; None if this process has none such."""
        current = self.current()
        return current if current is not None and current.digest == digest else None

    def ensure(self, prefix: ChunkKV, segments: Sequence[Sequence[int]]) -> ChannelTransform:
        """The transform, calibrated now from ``segments`` (after ``prefix``) if the store has none usable.

        The store is read again first (another process may have stored one since). Calibration
        prefills the first segments in a row, up to ``config.calibration_tokens`` tokens (fewer if
        they run out, or the model's context does), then stores the entry; if no tier takes it,
        this process still uses it (the chunks coded in it are misses for other processes).

        Raises:
            ValueError: no segment has 2 or more tokens.
        """
        if self._transform is not None:
            return self._transform
        self._transform, self._looked = self._read(), True
        if self._transform is not None:
            return self._transform
        ids, bounds = _calibration_ids(segments, min(self.config.calibration_tokens, self._room(prefix)))
        if not ids:
            raise ValueError("calibrating the channel transform needs a chunk of at least 2 tokens")
        # one prefill of the chunks in a row: the later ones see the earlier, as in a prompt
        kv = self.adapter.prefill_kv(ids, past=[prefix])
        slices = [kv.slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        transform = calibrate(slices, inv_freq=rope_frequencies(self.adapter))
        if self.config.sensitivity:
            kl = _sensitivity(
                self.adapter, prefix, ids, kv, level=min((v for v in self.config.levels if v >= 1), default=1)
            )
            if kl is not None:
                transform = dataclasses.replace(transform, step_scales=step_scales(kl))
        blob = transform_blob(transform, key=self.key, secret=self.store_secret)
        # every chunk coded in it depends on it: the highest recompute cost keeps it past any chunk
        if not self.store.put(self.key, blob, cost=_KEEP):
            logger.warning("no store tier accepted the channel transform %s; this process alone uses it", self.key)
        logger.info(
            "calibrated the channel transform %s on %d chunk tokens (keys in %d, values in %d of %d layers)",
            transform.digest[:16],
            len(ids),
            sum(transform.enabled[0]),
            sum(transform.enabled[1]),
            transform.shape[0],
        )
        self._transform = transform
        return transform

    def _read(self) -> ChannelTransform | None:
        data = self.store.get(self.key)
        if data is None:
            return None
        got = load_transform(data, key=self.key, model_fingerprint=self.adapter.fingerprint, secret=self.store_secret)
        if got is None:
            self.store.invalidate(self.key)  # damaged or foreign: a miss; the next calibration replaces it
        return got

    def _room(self, prefix: ChunkKV) -> int:
        """Tokens the model's context leaves after ``prefix``."""
        spec = getattr(self.adapter, "spec", None)
        return int(getattr(spec, "max_context", 1 << 30)) - prefix.num_tokens


def _calibration_ids(segments: Sequence[Sequence[int]], budget: int) -> tuple[list[int], list[int]]:
    """The first segments of 2+ tokens in a row, up to ``budget`` tokens (the first cut to fit), and their bounds.

    >>> _calibration_ids([[1], [2, 3, 4], [5, 6], [7, 8, 9]], 6)
    ([2, 3, 4, 5, 6], [0, 3, 5])
    """
    ids: list[int] = []
    bounds = [0]
    for seg in segments:
        if len(seg) < 2:
            continue
        if ids and len(ids) + len(seg) > budget:
            break
        ids.extend(list(seg)[:budget])
        bounds.append(len(ids))
    return ids, bounds


def _sensitivity(
    adapter: ModelAdapter, prefix: ChunkKV, ids: Sequence[int], kv: ChunkKV, level: int, tail: int = 32
) -> list[list[float]] | None:
    """Per K/V and layer, the mean KL one layer's noise alone causes on the calibration text's last ``tail`` tokens.

    The bench's ``measure_sensitivity`` scores a question and its answer over a prompt's chunks; at
    index time there is no question, so the calibration chunks (``kv``, one prefill of ``ids``) are
    split: all but their last ``tail`` tokens are the context, perturbed one (K/V, layer) at a time
    by uniform noise twice the level's step wide, and the last ``tail`` tokens are scored against
    the exact context. None when the text is shorter than ``2 * tail`` tokens.
    """
    if kv.num_tokens < 2 * tail:
        return None
    schedule = cachegen.LEVELS[level]
    gen = torch.Generator().manual_seed(0)
    layers = prefix.num_layers
    kl = [[0.0] * layers for _ in range(2)]
    head, suffix = kv.slice(0, kv.num_tokens - tail), list(ids[-tail:])
    exact = torch.log_softmax(adapter.suffix_logits([prefix, head], suffix).float(), dim=-1)
    for kind, relative, per_layer in ((0, schedule.key_steps, True), (1, schedule.value_steps, False)):
        for layer in range(layers):
            noisy = _perturbed(head, kind, layer, 2.0 * relative[schedule.group(layer, layers)], per_layer, gen)
            got = torch.log_softmax(adapter.suffix_logits([prefix, noisy], suffix).float(), dim=-1)
            kl[kind][layer] = float((exact.exp() * (exact - got)).sum(-1).mean())
    return kl


def _perturbed(kv: ChunkKV, kind: int, layer: int, rel: float, per_layer: bool, gen: torch.Generator) -> ChunkKV:
    """``kv`` with one layer's keys (``kind`` 0) or values (1) plus noise ``rel`` steps wide (first token kept)."""
    keys, values = kv.keys, kv.values
    x = (keys if kind == 0 else values).clone()
    y = x[layer : layer + 1, :, 1:].float()  # [1, H, T-1, D]
    step = cachegen.channel_sigma(y, per_layer) * rel
    noise = (torch.rand(y.shape, generator=gen) - 0.5).to(y.device) * step
    x[layer : layer + 1, :, 1:] = (y + noise).to(x.dtype)
    keys, values = (x, values) if kind == 0 else (keys, x)
    return ChunkKV(keys, values, kv.positions, kv.model_fingerprint)
