"""Cache-Craft (SIGMOD'25) for ``experiments/tune_fusion.py``: a recompute set stored with each chunk.

Cache-Craft records, per stored chunk, which tokens' cached K/V drift most once the chunk is placed
after other contexts, and at query time recomputes that stored set, with no check layer.
:func:`record_deviation` is the recorder: it places the chunk after a few other contexts, prefills
it there for real and scores each token by how far its real K/V lie from its cached K/V (re-rotated
to the same positions). Importing this module registers two fusion methods that rank by that score:
``craft`` (the stored score alone) and ``craft_query`` (times the question's attention, as
``query_focus`` weights the measured deviation). Cache-Craft also refreshes the score on every use;
only the index-time recording is here.

Measured on both prompt sets (docs/benchmarks-history.md, "Cache-Craft"): the stored set alone is
a weak ranking, and ``craft_query`` adds nothing the question's attention does not already give, so
neither ships with the library. The engine refuses methods that want stored scores.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragkv.model import ModelAdapter
from ragkv.selection import (
    SelectionState,
    Strategy,
    StrategyParams,
    check_sink_tokens,
    register_strategy,
    top_indices,
)
from ragkv.types import ChunkKV

__all__ = [
    "Craft",
    "CraftParams",
    "CraftQuery",
    "CraftQueryParams",
    "craft_contexts",
    "record_deviation",
    "stored_scores",
]

CRAFT_CONTEXTS = 3  # other chunks each chunk's deviation is recorded after


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
    roughly (``query_focus`` gains by checking again deeper); offline the full prefill is free, so
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


def craft_contexts(
    prompts: Sequence[Mapping[str, Any]], index: int, k: int = CRAFT_CONTEXTS, seed: int = 0
) -> list[list[str]]:
    """Per chunk of ``prompts[index]``, ``k`` chunk texts of the other prompts to record its deviation after.

    Drawn (seeded by ``seed``, the prompt and the chunk: the same prompts give the same draws)
    from the chunks of the other prompts that are not chunks of this one: a chunk recorded after
    its own neighbours would learn the answer's context. Empty lists when there is no such chunk.
    """
    own = set(prompts[index]["chunks"])
    pool = list(dict.fromkeys(c for j, p in enumerate(prompts) if j != index for c in p["chunks"] if c not in own))
    out = []
    for c in range(len(prompts[index]["chunks"])):
        rng = random.Random(seed * 1_000_003 + index * 1_009 + c)
        out.append(rng.sample(pool, min(k, len(pool))))
    return out


def stored_scores(
    adapter: ModelAdapter, prompt: Mapping[str, Any], contexts: Sequence[Sequence[str]]
) -> list[torch.Tensor]:
    """Each chunk's recorded deviation (index time) after its ``contexts`` (texts, one list per chunk)."""
    prefix, chunks, _ = adapter.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    pre = adapter.prefill_kv(prefix)
    out = []
    for ids, texts in zip(chunks, contexts, strict=True):
        other = adapter.chat_segments(prompt.get("system"), list(texts), prompt["question"])[1] if texts else []
        out.append(record_deviation(adapter, pre, adapter.prefill_kv(ids, past=[pre]), ids, other))
    return out


# ---- the two fusion methods ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CraftParams(StrategyParams):
    """``craft``: the tokens with the highest stored deviation."""

    sink_tokens: int = 2  # every later chunk's first tokens come first within the budget
    # the benches cache every chunk after the shared prefix, uncompressed: the first chunk is exact
    # (False: rank its tokens like the others)
    first_chunk_exact: bool = True

    def __post_init__(self) -> None:
        check_sink_tokens(self.sink_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class CraftQueryParams(StrategyParams):
    """``craft_query``: the stored deviation weighted by the question's attention after ``check_layer``."""

    check_layer: int = 1  # the question's attention is summed over the layers after this one
    sink_tokens: int = 2  # as craft's
    query_weight: float = 1.0  # exponent of the question-attention factor in the score
    first_chunk_exact: bool = True  # as craft's

    def __post_init__(self) -> None:
        check_sink_tokens(self.sink_tokens)
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")


@register_strategy
class Craft(Strategy):
    """Cache-Craft: recompute the ``ratio`` of tokens whose deviation, recorded at index time, is highest.

    No question probe and no check layer: the ranking comes with the chunks
    (``FusionInput.stored_scores``, from :func:`record_deviation`), so selecting costs nothing at
    query time. Every chunk's first ``sink_tokens`` come first within the budget.
    """

    name = "craft"
    Params = CraftParams
    params: CraftParams
    wants_stored_scores = True

    def score(self, state: SelectionState) -> torch.Tensor:
        """[chunk tokens] ranking score (higher = recompute first)."""
        return _stored(state, self.name)

    def initial(self, state: SelectionState) -> torch.Tensor:
        return _top_stored(state, self.ratio, self.score(state), self.params.sink_tokens, self.params.first_chunk_exact)


@register_strategy
class CraftQuery(Strategy):
    """The stored deviation times the attention the question pays each token; without a question, ``craft``."""

    name = "craft_query"
    Params = CraftQueryParams
    params: CraftQueryParams
    wants_query_attention = True
    wants_stored_scores = True

    def initial(self, state: SelectionState) -> torch.Tensor:
        return _top_stored(state, self.ratio, self.score(state), self.params.sink_tokens, self.params.first_chunk_exact)

    def score(self, state: SelectionState) -> torch.Tensor:
        stored = _stored(state, self.name)
        importance = state.question_importance(self.params.check_layer)
        if importance is None:
            return stored
        importance = importance / importance.mean().clamp_min(1e-12)
        weight = (importance + 1e-3).pow(self.params.query_weight)
        return stored / stored.mean().clamp_min(1e-12) * weight


def _top_stored(
    state: SelectionState, ratio: float, score: torch.Tensor, sink_tokens: int, first_chunk_exact: bool
) -> torch.Tensor:
    """The ``ratio`` of chunk tokens with the highest ``score``, every chunk's first ``sink_tokens`` first."""
    forced = state.sink_mask(torch.arange(state.num_chunk_tokens), sink_tokens)
    return top_indices(*state.skip_exact_first(first_chunk_exact, score, state.budget(ratio), forced))


def _stored(state: SelectionState, method: str) -> torch.Tensor:
    """The stored per-token scores, or a ValueError saying how to pass them."""
    if state.stored_scores is None:
        raise ValueError(
            f"fusion method {method!r} ranks tokens by the deviation recorded when each chunk was indexed; "
            "pass FusionInput(stored_scores=[experiments/craft.py record_deviation(...) for each chunk]) or "
            "choose a method that measures at query time (query_focus, blend)"
        )
    if state.stored_scores.shape != (state.num_chunk_tokens,):
        raise ValueError(
            f"stored_scores has shape {tuple(state.stored_scores.shape)}, expected ({state.num_chunk_tokens},): "
            "one score per chunk token"
        )
    return state.stored_scores
