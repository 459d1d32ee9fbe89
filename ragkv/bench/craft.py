"""Cache-Craft's index-time part: which of a chunk's tokens deviate most when it follows other text.

Cache-Craft (SIGMOD'25) records, per stored chunk, which tokens' cached K/V drift most once the
chunk is placed after other contexts, and at query time recomputes that stored set, with no
check layer. :func:`record_deviation` is the recorder: it places the chunk after a few other
contexts, prefills it there for real and scores each token by how far its real K/V lie from
its cached K/V (re-rotated to the same positions). The ``craft`` and ``craft_query`` fusion
methods (``ragkv.selection``) rank tokens by that score. Cache-Craft also refreshes the score on
every use; only the index-time recording is here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragkv.model import ModelAdapter
from ragkv.types import ChunkKV

__all__ = ["record_deviation"]


@torch.no_grad()
def record_deviation(
    adapter: ModelAdapter,
    prefix: ChunkKV,
    chunk: ChunkKV,
    chunk_ids: Sequence[int],
    contexts: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Per-token deviation ``[tokens]`` (float32, CPU) of ``chunk``'s cache when it follows each of ``contexts``.

    For each context, ``prefix + context + chunk`` is prefilled for real and the chunk's real K/V
    are compared with its cached K/V, re-rotated to the same positions. A token's score is its
    relative K/V deviation ``(||k - k'|| + ||v - v'||) / 2`` (each relative to the cached norm,
    over heads and head_dim), averaged over every layer but layer 0 and over the contexts.

    Why every layer and both K and V, not the check layer's V alone (what ``blend`` ranks by):
    at query time nothing is measured, so the stored score must stand for the whole stack. A
    token's drift builds up with depth and the early check layer predicts deep drift only
    roughly (``gradual`` gains by checking again deeper); offline the full prefill is free, so
    the score reads every layer. Layer 0 is skipped because it carries no signal (its K/V depend
    on the token and its position only, so after re-rotation they are exact). Keys count as
    much as values: a stale key misdirects the attention paid to the token, a stale value what it
    returns.

    Args:
        adapter: the model that computed ``prefix`` and ``chunk``.
        prefix: the shared prefix's exact KV (positions 0..P-1), the one ``chunk`` was cached after.
        chunk: the chunk's cached KV, computed right after ``prefix``.
        chunk_ids: the chunk's token ids.
        contexts: token ids of other text to place before the chunk (other chunks); an empty
            context reproduces the cache itself (score 0 up to re-rotation rounding).

    Returns:
        ``[len(chunk_ids)]`` float32 scores on the CPU; zeros when ``contexts`` is empty.
    """
    n = len(chunk_ids)
    if chunk.num_tokens != n:
        raise ValueError(f"chunk cache has {chunk.num_tokens} tokens but {n} token ids were given")
    score = torch.zeros(n, dtype=torch.float32)
    if n == 0 or not contexts:
        return score
    for context in contexts:
        start = prefix.num_tokens + len(context)
        real = adapter.prefill_kv([*context, *chunk_ids], past=[prefix])  # context + chunk after the prefix
        moved = adapter.rerotate(chunk, start)  # the cache as fusion would place it there
        k_dev = _relative(real.keys[:, :, len(context) :], moved.keys)  # [layers, tokens]
        dev = (k_dev + _relative(real.values[:, :, len(context) :], moved.values)) / 2
        score += (dev[1:] if dev.shape[0] > 1 else dev).mean(dim=0).cpu()
    return score / len(contexts)


def _relative(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Relative L2 deviation ``[layers, tokens]`` between ``[layers, heads, tokens, head_dim]`` tensors."""
    diff = (fresh.float() - cached.float()).pow(2).sum(dim=(1, 3))
    return (diff / cached.float().pow(2).sum(dim=(1, 3)).clamp_min(1e-12)).sqrt()
