"""transformers ``Cache`` objects: the scatter cache fusion writes through, and conversions to and from ChunkKV."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from ragkv.types import ChunkKV

__all__ = ["ScatterCache", "cache_kwarg", "cache_to_kv", "concat_kv", "crop_cache", "dynamic_cache"]


class _ScatterLayer(CacheLayerMixin):
    """A cache layer holding all context K/V, written at given slots (like a static cache's cache_position)."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys: torch.Tensor = keys  # [1, kv_heads, tokens, head_dim]
        self.values: torch.Tensor = values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.write_slots: torch.Tensor | None = None  # [q] slots the next update writes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise RuntimeError("ScatterCache layers are created initialized")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.write_slots is None:
            raise RuntimeError("ScatterCache.set_write_slots() must be called before running a layer")
        # key_states: [1, kv_heads, q, head_dim] -> written at their own slots, so every query sees
        # its own fresh key and the cached keys of every other slot.
        self.keys[:, :, self.write_slots] = key_states
        self.values[:, :, self.write_slots] = value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return int(self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.keys.shape[-2]), 0

    def get_max_length(self) -> int:
        return int(self.keys.shape[-2])


class ScatterCache(Cache):
    """A full-context cache whose layers overwrite K/V at chosen slots instead of appending.

    Fusion runs a subset of tokens through a decoder layer; their fresh K/V replace the cached
    entries at their own slots and their queries attend over the whole context. The layers are
    views of the tensors given, so those tensors hold the result.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # keys/values: [layers, kv_heads, tokens, head_dim]; each layer gets a [1, H, T, D] view
        layers = [_ScatterLayer(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])]
        super().__init__(layers=list[Any](layers))
        self._scatter_layers = layers

    def set_write_slots(self, layer_idx: int, slots: torch.Tensor) -> None:
        self._scatter_layers[layer_idx].write_slots = slots

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s whole-context keys and values, [1, kv_heads, tokens, head_dim] each."""
        layer = self._scatter_layers[layer_idx]
        return layer.keys, layer.values


def dynamic_cache(config: Any, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
    """A DynamicCache holding ``keys``/``values`` ``[layers, kv_heads, tokens, head_dim]`` (views of them).

    A full-attention layer holds its slice of the tensors given: ``DynamicLayer.update`` would
    concatenate it onto an empty tensor, a copy of the whole context (2.1 GB at 16K tokens of
    Llama-3.1-8B's shape, alive beside the fused buffer it came from). Appending later copies as
    it always does. Other layer kinds (a sliding window keeps its last slots) are filled through
    their own ``update``. A write into a layer writes into ``keys``/``values``: ragkv makes none
    (``DynamicLayer.reset`` in transformers before 5.16 zeroes a layer in place; ragkv never calls it).
    """
    cache = DynamicCache(config=config)
    for i in range(keys.shape[0]):
        k, v = keys[i : i + 1], values[i : i + 1]  # [1, H, T, D]
        layer = cache.layers[i] if i < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.update(k[:, :, :0], v[:, :, :0])  # initialized the layer's own way, on nothing
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, i)
    return cache


def _layer_tensors(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention cache layer's keys and values (the adapter refuses linear-attention layers)."""
    keys, values = layer.keys, layer.values
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise RuntimeError(f"cache layer {type(layer).__name__} holds no keys/values yet")
    return keys, values


def crop_cache(cache: Cache, num_tokens: int) -> None:
    """Drop everything after the first ``num_tokens`` slots of every layer (in place)."""
    for layer in cache.layers:
        keys, values = _layer_tensors(layer)
        layer.keys = keys[..., :num_tokens, :]  # type: ignore[union-attr]
        layer.values = values[..., :num_tokens, :]  # type: ignore[union-attr]


def cache_to_kv(cache: Cache, start: int, end: int, fingerprint: str) -> ChunkKV:
    """Slots ``start..end`` of every layer of ``cache`` as a ChunkKV at positions ``start..end``."""
    kv = [_layer_tensors(layer) for layer in cache.layers]
    keys = torch.stack([k[0, :, start:end] for k, _ in kv])  # [layers, H, end - start, D]
    values = torch.stack([v[0, :, start:end] for _, v in kv])
    return ChunkKV(keys=keys, values=values, positions=torch.arange(start, end), model_fingerprint=fingerprint)


def concat_kv(parts: Sequence[ChunkKV]) -> ChunkKV:
    """Concatenate chunk caches along tokens (they must come from one model)."""
    if not parts:
        raise ValueError("concat_kv needs at least one ChunkKV")
    fps = {p.model_fingerprint for p in parts}
    if len(fps) != 1:
        raise ValueError(f"cannot concatenate caches of different models: {sorted(fps)}")
    return ChunkKV(
        keys=torch.cat([p.keys for p in parts], dim=2),
        values=torch.cat([p.values for p in parts], dim=2),
        positions=torch.cat([p.positions for p in parts]),
        model_fingerprint=parts[0].model_fingerprint,
    )


_CACHE_KWARGS: dict[type, str] = {}  # module class -> its forward's Cache keyword


def cache_kwarg(module_type: type) -> str:
    """The keyword a transformers module's ``forward`` takes its Cache by.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns on the old name (a
    FutureWarning on every forward of every user's run); earlier 5.x releases, which vLLM's pins
    still require, know only ``past_key_values``.
    """
    kw = _CACHE_KWARGS.get(module_type)
    if kw is None:
        params = inspect.signature(module_type.forward).parameters  # type: ignore[attr-defined]
        kw = _CACHE_KWARGS[module_type] = "cache" if "cache" in params else "past_key_values"
    return kw
