"""Which chunk tokens fusion recomputes: strategies behind one interface, chosen by name.

A strategy says which tokens start active (run through layer 0), at which layers to measure
how far the fresh K/V of the active tokens deviate from their cached K/V, and which of the
active tokens to keep running after each such check layer. Tokens kept past the last check are
recomputed through every layer; the others keep their cached K/V from there on.

A strategy is made from the share of tokens to recompute (``ratio``) and its own parameter
record (``Strategy.Params``); it sees the prompt only through :class:`SelectionState`, built from
plain inputs (chunk lengths, measured deviations), so this module knows nothing of fusion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

__all__ = [
    "BlendParams",
    "BlendSinkParams",
    "BudgetParams",
    "CheckParams",
    "CraftParams",
    "CraftQueryParams",
    "ExactFirstParams",
    "GradualParams",
    "NoParams",
    "QueryAttnParams",
    "QueryFocusParams",
    "QueryGradualParams",
    "QueryParams",
    "SelectionState",
    "SinkParams",
    "Strategy",
    "StrategyParams",
    "available_strategies",
    "register_strategy",
    "strategy_class",
]


# ---- parameter records ---------------------------------------------------------------------
# Frozen and keyword-only, without slots: a strategy that combines two others' knobs inherits
# both records (QueryGradualParams = QueryParams + GradualParams), so every knob and its default
# is written once; slots would forbid two bases with fields. Each record checks its own fields,
# then calls up the chain.


@dataclass(frozen=True, kw_only=True)
class StrategyParams:
    """Base of the per-strategy parameter records."""

    def __post_init__(self) -> None:
        """End of the validation chain."""


@dataclass(frozen=True, kw_only=True)
class NoParams(StrategyParams):
    """The record of strategies without knobs (``naive``, ``full``, ``random``)."""


@dataclass(frozen=True, kw_only=True)
class SinkParams(StrategyParams):
    """``sink``: recompute the first tokens of every chunk."""

    sink_tokens: int = 2  # first tokens of every chunk always recomputed (sink repair)

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class CheckParams(StrategyParams):
    """A check layer: where deviations (or the question's attention after it) are read."""

    check_layer: int = 1  # layer whose K/V deviation ranks tokens (layer 0 carries no signal)

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class BlendParams(CheckParams):
    """``blend``: rank tokens by their K/V deviation at the check layer."""

    deviation: str = "v"  # "k", "v" or "kv": which deviation ranks tokens

    def __post_init__(self) -> None:
        if self.deviation not in ("k", "v", "kv"):
            raise ValueError(f"deviation must be 'k', 'v' or 'kv', got {self.deviation!r}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class BlendSinkParams(BlendParams, SinkParams):
    """``blend_sink``: blend's ranking with every chunk's first tokens forced in."""


@dataclass(frozen=True, kw_only=True)
class GradualParams(BlendParams):
    """``gradual``: a wide first cut at the check layer, narrowed at a deeper one."""

    narrow_factor: float = 2.0  # keep ratio * factor at the first check, ratio at the second
    narrow_layer: int = 0  # second check layer (0 = num_layers // 4)


@dataclass(frozen=True, kw_only=True)
class QueryParams(BlendSinkParams):
    """``query``: deviation weighted by the attention the question pays each token."""

    query_weight: float = 1.0  # exponent of the question-attention factor in the score


@dataclass(frozen=True, kw_only=True)
class ExactFirstParams(StrategyParams):
    """Whether the first chunk's cache is known to be exact (and so never worth recomputing)."""

    # True only where the first chunk's cache was computed right after the very same prefix, at the
    # same positions, and is not quantized (the fusion benches: every chunk cached after the shared
    # prefix, uncompressed): then it is exact, and recomputing it spends budget on nothing. The
    # engine's caches come through the codec and framework prefixes differ, so there it stays False.
    first_chunk_exact: bool = False


@dataclass(frozen=True, kw_only=True)
class QueryGradualParams(QueryParams, GradualParams):
    """``query_gradual``: query-aware scores with gradual narrowing."""


@dataclass(frozen=True, kw_only=True)
class QueryFocusParams(QueryGradualParams, ExactFirstParams):
    """``query_focus``: only the tokens the question attends most run the check layers."""

    focus_ratio: float = 0.4  # share of tokens the question attends most that start active


@dataclass(frozen=True, kw_only=True)
class BudgetParams(BlendSinkParams):
    """``budget``: recompute every token deviating more than a bound."""

    budget: float = 0.1  # recompute tokens whose relative deviation exceeds this ...
    max_ratio: float = 0.5  # ... up to this share


@dataclass(frozen=True, kw_only=True)
class QueryAttnParams(CheckParams, SinkParams, ExactFirstParams):
    """``query_attn``: the tokens the question attends most in the layers after ``check_layer``."""


@dataclass(frozen=True, kw_only=True)
class CraftParams(SinkParams, ExactFirstParams):
    """``craft``: the tokens with the highest deviation recorded at index time (``ragkv.bench.craft``).

    Its benches cache every chunk after the shared prefix, uncompressed, so ``first_chunk_exact``
    defaults to True here (False: rank the first chunk's tokens like the others)."""

    first_chunk_exact: bool = True


@dataclass(frozen=True, kw_only=True)
class CraftQueryParams(QueryAttnParams, CraftParams):
    """``craft_query``: the stored deviation weighted by the question's attention after ``check_layer``."""

    query_weight: float = 1.0  # exponent of the question-attention factor in the score
    first_chunk_exact: bool = True  # as craft's (QueryAttnParams, earlier in the MRO, says False)


# ---- what a strategy sees ------------------------------------------------------------------


@dataclass(slots=True)
class SelectionState:
    """What a strategy sees: the chunk layout and what fusion measured so far."""

    num_chunk_tokens: int
    chunk_starts: torch.Tensor  # [chunks] index of each chunk's first token among chunk tokens
    deviations: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> score [active]
    active: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> chunk-token indices measured
    query_attention: torch.Tensor | None = None  # [layers, chunk tokens], query-aware strategies only
    stored_scores: torch.Tensor | None = None  # [chunk tokens] deviation recorded at index time (craft methods)

    @classmethod
    def start(cls, chunk_lengths: Sequence[int]) -> SelectionState:
        """The state of a prompt whose chunks have ``chunk_lengths`` tokens, nothing measured yet."""
        lengths = torch.tensor(list(chunk_lengths), dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths if len(lengths) else torch.zeros(0, dtype=torch.long)
        return cls(num_chunk_tokens=int(lengths.sum()), chunk_starts=starts)

    def sink_mask(self, active: torch.Tensor, sink_tokens: int) -> torch.Tensor:
        """[active] True for tokens among the first ``sink_tokens`` of their chunk."""
        if sink_tokens == 0 or len(self.chunk_starts) == 0:
            return torch.zeros(active.shape, dtype=torch.bool)
        idx = torch.searchsorted(self.chunk_starts, active.cpu(), right=True) - 1
        return (active.cpu() - self.chunk_starts[idx]) < sink_tokens

    def budget(self, share: float) -> int:
        """Number of chunk tokens a ``share`` of them is (rounded, within [0, all])."""
        return max(0, min(self.num_chunk_tokens, round(share * self.num_chunk_tokens)))


def _top(score: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``k`` highest scores, ``forced`` ones first.

    Equal scores are picked in torch.topk's order, which is not by index (a tie at the cut takes
    any of the tied tokens); kept as is so selections stay what they were measured with.
    """
    if forced is not None and forced.any():
        score = score.clone()
        score[forced] = float("inf")
    k = min(k, score.numel())
    return torch.sort(torch.topk(score, k).indices).values if k > 0 else torch.zeros(0, dtype=torch.long)


def _question_importance(state: SelectionState, after_layer: int) -> torch.Tensor | None:
    """[chunk tokens] attention the question pays each token in the layers after ``after_layer``."""
    attn = state.query_attention
    if attn is None or attn.shape[-1] != state.num_chunk_tokens:
        return None
    later = attn[after_layer + 1 :] if attn.shape[0] > after_layer + 1 else attn
    return later.sum(dim=0)


def _sinks(state: SelectionState, sink_tokens: int) -> torch.Tensor:
    """Indices of every chunk's first ``sink_tokens`` tokens."""
    every = torch.arange(state.num_chunk_tokens)
    return every[state.sink_mask(every, sink_tokens)]


# ---- strategies ----------------------------------------------------------------------------


class Strategy:
    """A token-selection strategy for fusion: by default its tokens are fixed up front (no check layers).

    Args:
        ratio: share of chunk tokens to recompute through every layer, in [0, 1].
        params: the strategy's own record (``type(self).Params``); None = its defaults.
    """

    name: ClassVar[str]
    Params: ClassVar[type[StrategyParams]] = NoParams  # the record this strategy takes
    wants_query_attention: ClassVar[bool] = False  # fusion runs the question probe for it
    wants_stored_scores: ClassVar[bool] = False  # it ranks by deviation recorded at index time (ragkv.bench.craft)

    def __init__(self, ratio: float, params: StrategyParams | None = None) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        if params is None:
            params = self.Params()
        elif type(params) is not self.Params:
            raise TypeError(
                f"fusion method {self.name!r} takes {self.Params.__name__}, got {type(params).__name__}; "
                f"pass params={self.Params.__name__}(...) or leave params out for its defaults"
            )
        self.ratio = ratio
        self.params = params

    def initial(self, state: SelectionState) -> torch.Tensor:
        """Chunk-token indices that run through layer 0 (default: all)."""
        return torch.arange(state.num_chunk_tokens)

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        """Layers after which :meth:`observe` and :meth:`select` are called (default: none)."""
        return ()

    def observe(
        self, state: SelectionState, layer: int, active: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor
    ) -> None:
        """Record the deviations ``[active]`` of the ``active`` tokens' fresh K/V at check layer ``layer``."""
        raise RuntimeError(f"fusion method {self.name!r} has no check layers")

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        """Indices (into the currently active tokens) to keep running after check layer ``layer``."""
        raise RuntimeError(f"fusion method {self.name!r} has no check layers")


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown fusion method {name!r}; choose one of {sorted(_REGISTRY)}") from None


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


@register_strategy
class Naive(Strategy):
    """Reuse chunk caches as they are (positions corrected, nothing recomputed)."""

    name = "naive"

    def initial(self, state: SelectionState) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long)


@register_strategy
class Full(Strategy):
    """Recompute every chunk token: equals full prefill (the exactness reference)."""

    name = "full"


@register_strategy
class Sink(Strategy):
    """EPIC: recompute only the first ``sink_tokens`` of every chunk."""

    name = "sink"
    Params = SinkParams
    params: SinkParams

    def initial(self, state: SelectionState) -> torch.Tensor:
        return _sinks(state, self.params.sink_tokens)


@register_strategy
class Random(Strategy):
    """A random ``ratio`` of tokens (a control for the benchmark), seeded for repeatability."""

    name = "random"

    def initial(self, state: SelectionState) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        k = state.budget(self.ratio)
        return torch.sort(torch.randperm(state.num_chunk_tokens, generator=g)[:k]).values


class _Ranked(Strategy):
    """A strategy that measures K/V deviation at check layers and keeps the tokens it ranks highest."""

    Params = BlendParams
    params: BlendParams

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        return (min(self.params.check_layer, num_layers - 1),)

    def observe(
        self, state: SelectionState, layer: int, active: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor
    ) -> None:
        score = {"k": k_dev, "v": v_dev, "kv": k_dev + v_dev}[self.params.deviation]
        state.deviations[layer] = score.float().cpu()
        state.active[layer] = active.cpu()


@register_strategy
class Blend(_Ranked):
    """CacheBlend: every token through the check layer, keep the top ``ratio`` by K/V deviation."""

    name = "blend"

    def initial(self, state: SelectionState) -> torch.Tensor:
        # a budget of 0 recomputes nothing, not even the check layers: exactly naive reuse (sinks
        # are forced in within the budget, never on top of it)
        if state.budget(self.ratio) == 0:
            return torch.zeros(0, dtype=torch.long)
        return super().initial(state)

    def score(self, state: SelectionState, layer: int) -> torch.Tensor:
        """Ranking score of the tokens measured at ``layer`` (higher = recompute first)."""
        return state.deviations[layer]

    def share(self, state: SelectionState, layer: int) -> float:
        """Share of all chunk tokens to keep after ``layer``."""
        return self.ratio

    def forced(self, state: SelectionState, active: torch.Tensor) -> torch.Tensor | None:
        """[active] True for tokens kept whatever their score (none here)."""
        return None

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        forced = self.forced(state, state.active[layer])
        return _top(self.score(state, layer), state.budget(min(1.0, self.share(state, layer))), forced)


@register_strategy
class BlendSink(Blend):
    """CacheBlend selection with every chunk's first tokens forced in (sink repair, as EPIC)."""

    name = "blend_sink"
    Params = BlendSinkParams
    params: BlendSinkParams

    def forced(self, state: SelectionState, active: torch.Tensor) -> torch.Tensor | None:
        return state.sink_mask(active, self.params.sink_tokens)


@register_strategy
class Gradual(Blend):
    """Keep ``ratio * narrow_factor`` at the check layer, narrow to ``ratio`` at a deeper check layer.

    Deviation at an early layer predicts deep-layer deviation only roughly; measuring again
    deeper, among a wider first cut, picks better at little extra cost.
    """

    name = "gradual"
    Params = GradualParams
    params: GradualParams

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        first = min(self.params.check_layer, num_layers - 1)
        second = min(self.params.narrow_layer or max(first + 1, num_layers // 4), num_layers - 1)
        return (first, second) if second > first else (first,)

    def share(self, state: SelectionState, layer: int) -> float:
        first_check = len(state.deviations) == 1
        return self.ratio * (self.params.narrow_factor if first_check else 1.0)


@register_strategy
class QueryAware(BlendSink):
    """Ours: rank by K/V deviation times the attention the question pays each token in later layers.

    The question is known at fusion time. A token's stale K/V can only change the answer through
    the attention the question (and answer) pay it, so the question is run through every layer
    on the naively placed cache (a few dozen tokens, ~1% of a prefill) and each token's attention
    share in the layers after the check layer weights its deviation.
    """

    name = "query"
    Params = QueryParams
    params: QueryParams
    wants_query_attention = True

    def score(self, state: SelectionState, layer: int) -> torch.Tensor:
        score = state.deviations[layer]
        everywhere = _question_importance(state, layer)
        if everywhere is None:
            return score
        importance = everywhere[state.active[layer]]
        importance = importance / importance.mean().clamp_min(1e-12)
        return score / score.mean().clamp_min(1e-12) * (importance + 1e-3).pow(self.params.query_weight)


@register_strategy
class QueryGradual(QueryAware, Gradual):
    """Query-aware scores with gradual narrowing (a wide first cut, re-ranked deeper)."""

    name = "query_gradual"
    Params = QueryGradualParams
    params: QueryGradualParams


@register_strategy
class QueryFocus(QueryGradual):
    """Ours, cheaper: only the ``focus_ratio`` of tokens the question attends most run the check layers.

    Layer-0 K/V depend on the token and its position only, so after re-rotation every cached
    layer-0 entry is exact and a subset of tokens can run from layer 0 without the others. Tokens
    the question barely attends cannot change the answer much, so skipping their check layers
    loses little and saves most of the two full-width layers query_gradual pays for.
    """

    name = "query_focus"
    Params = QueryFocusParams
    params: QueryFocusParams

    def initial(self, state: SelectionState) -> torch.Tensor:
        p = self.params
        every = torch.arange(state.num_chunk_tokens)
        importance = _question_importance(state, p.check_layer)
        share = max(p.focus_ratio, self.ratio * p.narrow_factor)
        if importance is None or state.budget(self.ratio) == 0:
            return super().initial(state)  # no question: query_gradual's; budget 0: naive
        forced = state.sink_mask(every, p.sink_tokens)
        return _top(*_skip_exact_first(state, p, importance, state.budget(min(1.0, share)), forced))


@register_strategy
class Budget(_Ranked):
    """Ours: recompute every token whose relative deviation exceeds ``budget`` (up to ``max_ratio``).

    A quality bound instead of a fixed ratio (``ratio`` is not used): prompts whose chunks barely
    interact cost little.
    """

    name = "budget"
    Params = BudgetParams
    params: BudgetParams

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        p = self.params
        score = state.deviations[layer]
        over = int((score > p.budget).sum())
        k = min(over, state.budget(p.max_ratio))
        return _top(score, k, state.sink_mask(state.active[layer], p.sink_tokens))


@register_strategy
class QueryAttention(Strategy):
    """Recompute the ``ratio`` of tokens the question attends most; no check layers.

    Every chunk's first ``sink_tokens`` come first within that budget. Without a question (no
    suffix) it recomputes those first tokens only, as ``sink`` does.
    """

    name = "query_attn"
    Params = QueryAttnParams
    params: QueryAttnParams
    wants_query_attention = True

    def initial(self, state: SelectionState) -> torch.Tensor:
        p = self.params
        every = torch.arange(state.num_chunk_tokens)
        importance = _question_importance(state, p.check_layer)
        if importance is None:  # no question: what `sink` recomputes
            return _sinks(state, p.sink_tokens)
        forced = state.sink_mask(every, p.sink_tokens)
        return _top(*_skip_exact_first(state, p, importance, state.budget(self.ratio), forced))


@register_strategy
class Craft(Strategy):
    """Cache-Craft: recompute the ``ratio`` of tokens whose deviation, recorded at index time, is highest.

    No question probe and no check layer: the ranking comes with the chunks
    (``FusionInput.stored_scores``, from :func:`ragkv.bench.craft.record_deviation`), so selecting costs
    nothing at query time. Every chunk's first ``sink_tokens`` come first within the budget.
    """

    name = "craft"
    Params = CraftParams
    params: CraftParams
    wants_stored_scores = True

    def score(self, state: SelectionState) -> torch.Tensor:
        """[chunk tokens] ranking score (higher = recompute first)."""
        return _stored(state, self.name)

    def initial(self, state: SelectionState) -> torch.Tensor:
        every = torch.arange(state.num_chunk_tokens)
        forced = state.sink_mask(every, self.params.sink_tokens)
        return _top(*_skip_exact_first(state, self.params, self.score(state), state.budget(self.ratio), forced))


@register_strategy
class CraftQuery(Craft):
    """Ours on Cache-Craft: the stored deviation times the attention the question pays each token.

    The question probe (as ``query_attn``) weights the stored score the way ``query`` weights
    the measured one; no check layer. Without a question it is ``craft``.
    """

    name = "craft_query"
    Params = CraftQueryParams
    params: CraftQueryParams
    wants_query_attention = True

    def score(self, state: SelectionState) -> torch.Tensor:
        stored = _stored(state, self.name)
        importance = _question_importance(state, self.params.check_layer)
        if importance is None:
            return stored
        importance = importance / importance.mean().clamp_min(1e-12)
        weight = (importance + 1e-3).pow(self.params.query_weight)
        return stored / stored.mean().clamp_min(1e-12) * weight


def _skip_exact_first(
    state: SelectionState, params: ExactFirstParams, score: torch.Tensor, k: int, forced: torch.Tensor
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(score, k, forced)`` for ``_top``, with the first chunk's tokens out of the running when
    ``params.first_chunk_exact`` (the budget then goes to the later chunks); unchanged otherwise."""
    if not params.first_chunk_exact or not len(state.chunk_starts):
        return score, k, forced
    every = torch.arange(state.num_chunk_tokens)
    first = every < (state.chunk_starts[1] if len(state.chunk_starts) > 1 else state.num_chunk_tokens)
    score = score.clone()
    score[first] = float("-inf")
    return score, min(k, state.num_chunk_tokens - int(first.sum())), forced & ~first


def _stored(state: SelectionState, method: str) -> torch.Tensor:
    """The stored per-token scores, or a ValueError saying how to pass them."""
    if state.stored_scores is None:
        raise ValueError(
            f"fusion method {method!r} ranks tokens by the deviation recorded when each chunk was indexed; "
            "pass FusionInput(stored_scores=[ragkv.bench.craft.record_deviation(...) for each chunk]) or choose "
            "a method that measures at query time (query_focus, query_attn)"
        )
    if state.stored_scores.shape != (state.num_chunk_tokens,):
        raise ValueError(
            f"stored_scores has shape {tuple(state.stored_scores.shape)}, expected ({state.num_chunk_tokens},): "
            "one score per chunk token"
        )
    return state.stored_scores
