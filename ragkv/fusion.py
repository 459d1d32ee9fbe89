"""Fusion: turn a cached prefix and independently computed chunk caches into one prompt cache.

Chunk caches computed on their own lack attention to the chunks before them. Fusion re-rotates
each chunk to its offset, then recomputes a selected subset of chunk tokens layer by layer
through the model's own decoder layers (their queries see the whole fused cache with the exact
causal mask, their fresh K/V replace the cached entries), as CacheBlend does, with selection
strategies from a registry (see ``ragkv.selection``).

Shapes: K/V are ``[layers, kv_heads, tokens, head_dim]``; hidden states ``[1, q, hidden]``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from ragkv.model import ModelAdapter, ScatterCache, concat_kv
from ragkv.selection import FusionConfig, SelectionState, get_strategy
from ragkv.types import ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["FusionInput", "FusedContext", "fuse"]


@dataclass(frozen=True, slots=True)
class FusionInput:
    """What fusion needs for one prompt."""

    prefix: ChunkKV  # exact KV of the shared prefix, positions 0..P-1
    chunks: Sequence[ChunkKV]  # each chunk's cached KV, at whatever positions it was computed
    chunk_ids: Sequence[Sequence[int]]  # each chunk's token ids (to embed recomputed tokens)
    suffix_ids: Sequence[int] = ()  # question + generation prompt (query-aware selection reads it)
    forced: Sequence[bool] = ()  # per chunk: True = no cache (placeholder KV), recompute every token


@dataclass(slots=True)
class FusedContext:
    """The fused prompt cache, ready for the suffix."""

    cache: DynamicCache  # holds prefix + chunks, positions 0..N-1
    num_tokens: int  # N
    recomputed_tokens: int  # cached chunk tokens recomputed through every layer after the check layers
    chunk_tokens: int  # all chunk tokens
    forced_tokens: int = 0  # tokens of uncached segments, computed through every layer
    selected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # final slots


def _place(adapter: ModelAdapter, inp: FusionInput) -> tuple[ChunkKV, torch.Tensor, torch.Tensor]:
    """Re-rotate chunks to their offsets and concatenate; return (kv, chunk slots, chunk token ids)."""
    parts, slots, ids = [inp.prefix], [], []
    offset = inp.prefix.num_tokens
    if len(inp.chunks) != len(inp.chunk_ids):
        raise ValueError("FusionInput needs one token-id list per chunk")
    for kv, tok in zip(inp.chunks, inp.chunk_ids, strict=True):
        if kv.num_tokens != len(tok):
            raise ValueError(f"chunk cache has {kv.num_tokens} tokens but {len(tok)} token ids were given")
        parts.append(adapter.rerotate(kv, offset))
        slots.append(torch.arange(offset, offset + kv.num_tokens))
        ids.append(torch.as_tensor(list(tok), dtype=torch.long))
        offset += kv.num_tokens
    empty = torch.zeros(0, dtype=torch.long)
    return concat_kv(parts), (torch.cat(slots) if slots else empty), (torch.cat(ids) if ids else empty)


def _to_dynamic(adapter: ModelAdapter, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=adapter.model.config)
    for i in range(keys.shape[0]):
        cache.update(keys[i : i + 1], values[i : i + 1], i)
    return cache


def _deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 deviation ``[q]`` between ``[1, H, q, D]`` tensors."""
    diff = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 1, 3))
    return (diff / cached.float().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)).sqrt()


@torch.no_grad()
def fuse(adapter: ModelAdapter, inp: FusionInput, config: FusionConfig | None = None) -> FusedContext:
    """Fuse ``inp`` into one cache, recomputing the tokens ``config``'s strategy selects."""
    config = config or FusionConfig()
    strategy = get_strategy(config.method)
    kv, slots, ids = _place(adapter, inp)
    n_chunk = int(slots.numel())
    keys = kv.keys.to(device=adapter.device, dtype=adapter.dtype).contiguous()
    values = kv.values.to(device=adapter.device, dtype=adapter.dtype).contiguous()
    state = SelectionState.start(config, inp, n_chunk)
    forced = _forced_tokens(inp)
    active = _union(strategy.initial(state), forced)  # indices into the chunk tokens
    if n_chunk == 0 or active.numel() == 0:
        return FusedContext(_to_dynamic(adapter, keys, values), kv.num_tokens, 0, n_chunk)

    num_layers = adapter.spec.num_layers
    checks = set(strategy.check_layers(state, num_layers))
    cache = ScatterCache(keys, values)
    slots_dev = slots.to(adapter.device)
    hidden = adapter.embed(ids[active])
    if strategy.wants_query_attention and len(inp.suffix_ids) > 0:
        state.query_attention = _question_attention(adapter, keys, values, inp.suffix_ids, slots_dev)
    pos = mask = pe = None
    for layer in range(num_layers):
        if pos is None:  # the active set changed: new positions, mask and rotary tables
            pos = slots_dev[active]
            mask = adapter.causal_mask(pos, kv.num_tokens, hidden.dtype)
            pe = adapter.position_embeddings(pos, hidden)
        assert pos is not None and mask is not None and pe is not None
        if layer in checks:
            layer_k, layer_v = cache.layer_kv(layer)
            old_k, old_v = layer_k[:, :, pos].clone(), layer_v[:, :, pos].clone()
        hidden = adapter.run_layer(layer, hidden, pos, cache, pe, mask)
        if layer in checks:
            layer_k, layer_v = cache.layer_kv(layer)
            state.observe(
                layer,
                active,
                k_dev=_deviation(layer_k[:, :, pos], old_k),
                v_dev=_deviation(layer_v[:, :, pos], old_v),
            )
            is_forced = torch.isin(active, forced)
            state.deviations[layer][is_forced] = 0.0  # uncached tokens never compete for the budget
            keep = strategy.select(state, layer)  # positions within `active` to keep
            keep = _union(keep, torch.nonzero(is_forced).flatten())
            active, hidden = active[keep], hidden[:, keep.to(hidden.device)]
            pos = None
            if active.numel() == 0:
                break
    # the scatter cache's layers are views of `keys`/`values`: they already hold the fused K/V
    recomputed = int(active.numel()) - int(forced.numel())
    return FusedContext(
        _to_dynamic(adapter, keys, values),
        kv.num_tokens,
        recomputed,
        n_chunk,
        forced_tokens=int(forced.numel()),
        selected=slots[active.cpu()],
    )


def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted union of two index tensors."""
    return torch.unique(torch.cat([a.cpu(), b.cpu()])) if b.numel() else a


def _forced_tokens(inp: FusionInput) -> torch.Tensor:
    """Indices (among chunk tokens) of the tokens of uncached segments."""
    out, start = [], 0
    for i, ids in enumerate(inp.chunk_ids):
        if i < len(inp.forced) and inp.forced[i]:
            out.append(torch.arange(start, start + len(ids)))
        start += len(ids)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _question_attention(
    adapter: ModelAdapter, keys: torch.Tensor, values: torch.Tensor, suffix_ids: Sequence[int], slots: torch.Tensor
) -> torch.Tensor:
    """Attention the question pays each chunk token, per layer: ``[layers, n_chunk]``.

    Runs the suffix (a few dozen tokens: about 1% of a prefill) through every layer on a copy of
    the naively placed cache and records the attention weights, normalized per layer.
    """
    n_ctx = keys.shape[2]
    q_ids = torch.as_tensor(list(suffix_ids), dtype=torch.long)
    pad = torch.zeros(keys.shape[0], keys.shape[1], len(q_ids), keys.shape[3], dtype=keys.dtype, device=keys.device)
    probe_cache = ScatterCache(torch.cat([keys, pad], dim=2), torch.cat([values, pad.clone()], dim=2))
    pos = torch.arange(n_ctx, n_ctx + len(q_ids), device=adapter.device)
    hidden = adapter.embed(q_ids)
    mask = adapter.causal_mask(pos, n_ctx + len(q_ids), hidden.dtype)
    pe = adapter.position_embeddings(pos, hidden)
    with adapter.attention_probe() as probe:
        for layer in range(adapter.spec.num_layers):
            hidden = adapter.run_layer(layer, hidden, pos, probe_cache, pe, mask)
    per_layer = torch.stack([probe.weights[i][slots].float() for i in range(adapter.spec.num_layers)])
    return (per_layer / per_layer.sum(dim=1, keepdim=True).clamp_min(1e-12)).cpu()
