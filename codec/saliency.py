"""Per-token saliency for the salient-token levels of ``cachegen`` (ZipCache-style).

ZipCache ranks tokens by *normalized* attention: the attention a token receives, summed over the
queries that can see it, divided by how many can. Causal attention lets early tokens collect mass
from many more queries than late ones; without the division the ranking would mostly be position.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["normalized_attention", "proxy_saliency"]


def normalized_attention(weights: Mapping[int, torch.Tensor], num_tokens: int) -> torch.Tensor:
    """Saliency ``[num_tokens]`` of the last ``num_tokens`` slots from an attention probe's weights.

    Args:
        weights: layer -> ``[kv_len]`` attention each slot received, summed over heads and over the
            queries of one prefill whose queries are the last ``num_tokens`` slots (what
            ``ModelAdapter.attention_probe()`` records around ``prefill_kv``).
        num_tokens: the chunk's tokens (the prefill's queries).

    Returns:
        Each token's attention per query that could see it, each layer normalized to sum 1, then
        averaged over layers (so no layer dominates by scale).
    """
    if not weights:
        raise ValueError("no attention weights recorded; run prefill_kv inside adapter.attention_probe()")
    seen_by = torch.arange(num_tokens, 0, -1, dtype=torch.float32)  # token t is seen by T - t queries
    total = torch.zeros(num_tokens)
    for w in weights.values():
        received = w.detach().float().cpu()[-num_tokens:] / seen_by
        total += received / received.sum().clamp_min(1e-30)
    return total / len(weights)


def proxy_saliency(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A saliency ``[tokens]`` from the KV alone, for callers without attention weights.

    A token whose keys lie far from the chunk's typical key (in units of each channel's spread)
    draws attention unlike its neighbours (sinks, delimiters); one whose values are far off moves
    the output most when it is attended. Mean squared z-score over layers, heads and channels.
    """
    score = torch.zeros(keys.shape[2])
    for x in (keys, values):
        y = x.float()
        z = (y - y.mean(dim=2, keepdim=True)) / y.std(dim=2, correction=0, keepdim=True).clamp_min(1e-6)
        score += z.pow(2).mean(dim=(0, 1, 3))
    return score
