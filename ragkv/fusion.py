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

from ragkv.model import ModelAdapter, ScatterCache
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

    cache: DynamicCache  # prefix + chunks at positions 0..N-1 (+ the suffix after, with prefill_suffix)
    num_tokens: int  # N: prefix + chunk tokens (the suffix starts here)
    recomputed_tokens: int  # cached chunk tokens recomputed through every layer after the check layers
    chunk_tokens: int  # all chunk tokens
    forced_tokens: int = 0  # tokens of uncached segments, computed through every layer
    selected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # final slots
    suffix_logits: torch.Tensor | None = None  # [suffix, vocab] fp32 when fused with prefill_suffix


def _place(
    adapter: ModelAdapter, inp: FusionInput, extra: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-rotate chunks to their offsets into one buffer with ``extra`` free slots at the end.

    Returns (keys, values) ``[layers, kv_heads, N + extra, head_dim]`` in the model's dtype and
    device, the chunk tokens' slots and their token ids.
    """
    if len(inp.chunks) != len(inp.chunk_ids):
        raise ValueError("FusionInput needs one token-id list per chunk")
    for kv, tok in zip(inp.chunks, inp.chunk_ids, strict=True):
        if kv.num_tokens != len(tok):
            raise ValueError(f"chunk cache has {kv.num_tokens} tokens but {len(tok)} token ids were given")
    fps = {p.model_fingerprint for p in (inp.prefix, *inp.chunks)}
    if len(fps) != 1:
        raise ValueError(f"cannot fuse caches of different models: {sorted(fps)}")
    n_prefix = inp.prefix.num_tokens
    total = n_prefix + sum(kv.num_tokens for kv in inp.chunks)
    s = adapter.spec
    shape = (s.num_layers, s.num_kv_heads, total + extra, s.head_dim)
    keys = torch.zeros(shape, dtype=adapter.dtype, device=adapter.device)
    values = torch.zeros(shape, dtype=adapter.dtype, device=adapter.device)
    keys[:, :, :n_prefix] = inp.prefix.keys
    values[:, :, :n_prefix] = inp.prefix.values
    offset = n_prefix
    for kv in inp.chunks:
        end = offset + kv.num_tokens
        keys[:, :, offset:end] = adapter.rerotate(kv, offset).keys
        values[:, :, offset:end] = kv.values
        offset = end
    slots = torch.arange(n_prefix, total)
    ids = [torch.as_tensor(list(tok), dtype=torch.long) for tok in inp.chunk_ids]
    return keys, values, slots, (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long))


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
def fuse(
    adapter: ModelAdapter, inp: FusionInput, config: FusionConfig | None = None, *, prefill_suffix: bool = False
) -> FusedContext:
    """Fuse ``inp`` into one cache, recomputing the tokens ``config``'s strategy selects.

    With ``prefill_suffix``, the suffix runs through every layer together with the recomputed
    tokens (it sees each layer's fused K/V, exactly as a prefill after fusion would) and the
    result holds its logits and K/V: one pass over the layers instead of two.
    """
    config = config or FusionConfig()
    strategy = get_strategy(config.method)
    suffix = torch.as_tensor(list(inp.suffix_ids), dtype=torch.long)
    n_suffix = int(suffix.numel())
    probe = strategy.wants_query_attention and n_suffix > 0
    keys, values, slots, ids = _place(adapter, inp, n_suffix if (probe or prefill_suffix) else 0)
    n_ctx = inp.prefix.num_tokens + int(slots.numel())
    n_chunk = int(slots.numel())
    state = SelectionState.start(config, inp, n_chunk)
    slots_dev = slots.to(adapter.device)
    if probe and n_chunk > 0:
        state.query_attention = _question_attention(adapter, keys, values, suffix, n_ctx, slots_dev)
    forced = _forced_tokens(inp)
    active = _union(strategy.initial(state), forced)  # indices into the chunk tokens
    if n_chunk == 0 or active.numel() == 0:
        placed = _to_dynamic(adapter, keys[:, :, :n_ctx], values[:, :, :n_ctx])
        logits = adapter.forward(suffix, placed, n_ctx) if prefill_suffix and n_suffix else None
        return FusedContext(placed, n_ctx, 0, n_chunk, suffix_logits=logits)

    num_layers = adapter.spec.num_layers
    checks = set(strategy.check_layers(state, num_layers))
    cache = ScatterCache(keys, values)
    hidden = adapter.embed(ids[active])
    # the suffix rides along after the active chunk tokens through every layer
    tail = n_suffix if prefill_suffix else 0
    tail_pos = torch.arange(n_ctx, n_ctx + tail, device=adapter.device)
    if tail:
        hidden = torch.cat([hidden, adapter.embed(suffix)], dim=1)
    pos = mask = pe = None
    for layer in range(num_layers):
        if pos is None:  # the active set changed: new positions, mask and rotary tables
            pos = slots_dev[active]
            run_pos = torch.cat([pos, tail_pos])
            mask = adapter.causal_mask(run_pos, keys.shape[2], hidden.dtype)
            pe = adapter.position_embeddings(run_pos, hidden)
        assert pos is not None and mask is not None and pe is not None
        if layer in checks:
            layer_k, layer_v = cache.layer_kv(layer)
            old_k, old_v = layer_k[:, :, pos].clone(), layer_v[:, :, pos].clone()
        hidden = adapter.run_layer(layer, hidden, run_pos, cache, pe, mask)
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
            rows = torch.cat([keep, torch.arange(active.numel(), active.numel() + tail)])
            active, hidden = active[keep], hidden[:, rows.to(hidden.device)]
            pos = None
            if active.numel() == 0 and not tail:
                break
    # the scatter cache's layers are views of `keys`/`values`: they already hold the fused K/V
    logits = adapter.final_logits(hidden[:, hidden.shape[1] - tail :])[0] if tail else None
    kept = n_ctx + tail
    recomputed = int(active.numel()) - int(forced.numel())
    return FusedContext(
        _to_dynamic(adapter, keys[:, :, :kept], values[:, :, :kept]),
        n_ctx,
        recomputed,
        n_chunk,
        forced_tokens=int(forced.numel()),
        selected=slots[active.cpu()],
        suffix_logits=logits,
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
    adapter: ModelAdapter,
    keys: torch.Tensor,
    values: torch.Tensor,
    suffix: torch.Tensor,
    n_ctx: int,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Attention the question pays each chunk token, per layer: ``[layers, n_chunk]``.

    Runs the suffix (a few dozen tokens: about 1% of a prefill) through every layer on the
    naively placed cache and records the attention weights, normalized per layer. Its K/V go to
    the free slots after the context (``keys``/``values`` have ``len(suffix)`` of them), which
    fusion overwrites or drops; the context slots are not touched.
    """
    probe_cache = ScatterCache(keys, values)
    pos = torch.arange(n_ctx, n_ctx + len(suffix), device=adapter.device)
    hidden = adapter.embed(suffix)
    mask = adapter.causal_mask(pos, keys.shape[2], hidden.dtype)
    pe = adapter.position_embeddings(pos, hidden)
    with adapter.attention_probe() as probe:
        for layer in range(adapter.spec.num_layers):
            hidden = adapter.run_layer(layer, hidden, pos, probe_cache, pe, mask)
    per_layer = torch.stack([probe.weights[i][slots].float() for i in range(adapter.spec.num_layers)])
    return (per_layer / per_layer.sum(dim=1, keepdim=True).clamp_min(1e-12)).cpu()
