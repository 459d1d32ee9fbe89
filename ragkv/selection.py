"""Which chunk tokens fusion recomputes: a few strategies behind one interface, chosen by name.

A strategy says which tokens start active (run through layer 0), at which layers to measure
how far the fresh K/V of the active tokens deviate from their cached K/V, and which of the
active tokens to keep running after each such check layer. Tokens kept past the last check are
recomputed through every layer; the others keep their cached K/V from there on.

The ones that ship are those a user would choose (docs/benchmarks.md, "Fusion"): ``naive`` (reuse
as is, the cheapest), ``full`` (recompute everything: full prefill, the exactness reference),
``blend`` (CacheBlend, the baseline) and ``query_focus`` (the default). Research variants measured
once and set aside are in docs/benchmarks-history.md; ``experiments/craft.py`` registers the
Cache-Craft pair for ``experiments/tune_fusion.py``.

A strategy is made from the share of tokens to recompute (``ratio``) and its own flat parameter
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
    "NoParams",
    "QueryFocusParams",
    "SelectionState",
    "Strategy",
    "StrategyParams",
    "available_strategies",
    "coverage_count",
    "register_strategy",
    "strategy_class",
    "top_indices",
]


# ---- parameter records ---------------------------------------------------------------------
# Flat, frozen and keyword-only: each record lists every knob of its strategy with its default
# (no record inherits another's fields), and checks them itself.


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyParams:
    """Base of the per-strategy parameter records (no fields: it only names the family)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NoParams(StrategyParams):
    """The record of strategies without knobs (``naive``, ``full``)."""


def check_layer_knobs(check_layer: int, deviation: str) -> None:
    """ValueError unless ``check_layer >= 0`` and ``deviation`` is ``"k"``, ``"v"`` or ``"kv"``."""
    if check_layer < 0:
        raise ValueError(f"check_layer must be >= 0, got {check_layer}")
    if deviation not in ("k", "v", "kv"):
        raise ValueError(f"deviation must be 'k', 'v' or 'kv', got {deviation!r}")


def check_sink_tokens(sink_tokens: int) -> None:
    """ValueError unless ``sink_tokens >= 0``."""
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendParams(StrategyParams):
    """``blend`` (CacheBlend): rank tokens by their K/V deviation at one check layer."""

    check_layer: int = 1  # layer whose K/V deviation ranks tokens (layer 0 carries no signal)
    deviation: str = "v"  # "k", "v" or "kv": which deviation ranks tokens

    def __post_init__(self) -> None:
        check_layer_knobs(self.check_layer, self.deviation)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryFocusParams(StrategyParams):
    """``query_focus``: the tokens the question attends most, ranked by deviation times attention.

    Defaults from ``experiments/tune_fusion.py`` on the first four built-in prompts
    (docs/benchmarks.md, "Fusion").
    """

    check_layer: int = 1  # first check layer (layer 0 carries no signal)
    deviation: str = "v"  # "k", "v" or "kv": which deviation ranks tokens
    sink_tokens: int = 2  # first tokens of every chunk always kept (sink repair, as EPIC)
    query_weight: float = 1.0  # exponent of the question-attention factor in the score
    narrow_factor: float = 2.0  # keep ratio * factor at the first check, ratio at the second
    narrow_layer: int = 0  # second check layer (0 = max(check_layer + 1, num_layers // 4))
    focus_ratio: float = 0.4  # share of tokens the question attends most that start active
    # True only where the first chunk's cache was computed right after the very same prefix, at the
    # same positions, and is not quantized (the fusion benches): then it is exact, and recomputing it
    # spends budget on nothing. The engine's caches come through the codec and framework prefixes
    # differ, so there it stays False (measured a wash in the benches; docs/benchmarks-history.md).
    first_chunk_exact: bool = False
    # Numbers (issue 36: most answers the default lost to full prefill were numbers, a digit changed
    # or a near-miss figure taken): a selected token of a number pulls in the whole number (its
    # digit tokens and the separators between them), and number tokens' scores are multiplied by
    # ``number_boost``. Off by default until measured on two model sizes (docs/benchmarks.md).
    number_spans: bool = False
    number_boost: float = 1.0
    # An adaptive share (issue 36): > 0 keeps, at the last check layer, the fewest top-scored tokens
    # holding this share of the score mass there, with ``ratio`` as the cap and ``min_ratio`` (clamped
    # to the cap) as the floor; 0 = off, ``ratio`` is a fixed share. A target the cap cuts short is
    # reported (FusedContext.selection_capped), never dropped. Off by default until measured.
    coverage: float = 0.0
    min_ratio: float = 0.05  # the least share of chunk tokens kept under ``coverage`` (unused when off)

    def __post_init__(self) -> None:
        check_layer_knobs(self.check_layer, self.deviation)
        check_sink_tokens(self.sink_tokens)
        if self.number_boost <= 0:
            raise ValueError(f"number_boost must be > 0 (1 = no boost), got {self.number_boost}")
        if not 0.0 <= self.coverage <= 1.0:
            raise ValueError(
                f"coverage must be in [0, 1] (the share of the last check's score mass to keep; "
                f"0 = off, ratio is then a fixed share), got {self.coverage}"
            )
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(
                f"min_ratio must be in [0, 1] (the least share of chunk tokens kept under coverage; "
                f"the fusion ratio caps it), got {self.min_ratio}"
            )
        if self.narrow_layer < 0:
            raise ValueError(f"narrow_layer must be >= 0 (0 = num_layers // 4), got {self.narrow_layer}")
        if not 0.0 <= self.focus_ratio <= 1.0:
            raise ValueError(f"focus_ratio must be in [0, 1], got {self.focus_ratio}")


# ---- what a strategy sees ------------------------------------------------------------------


@dataclass(slots=True)
class SelectionState:
    """What a strategy sees: the chunk layout and what fusion measured so far."""

    num_chunk_tokens: int
    chunk_starts: torch.Tensor  # [chunks] index of each chunk's first token among chunk tokens
    deviations: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> score [active]
    active: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> chunk-token indices measured
    query_attention: torch.Tensor | None = None  # [layers, chunk tokens], query-aware strategies only
    # [chunk tokens] deviation recorded at index time, for strategies with wants_stored_scores
    # (experiments/craft.py)
    stored_scores: torch.Tensor | None = None
    # [chunk tokens] id of the number each token belongs to (-1: none), for strategies that
    # ask for it (``wants_numbers``); see ragkv.model.ModelAdapter.number_runs
    number_runs: torch.Tensor | None = None
    # the check layers of this pass, in order, as fusion runs them (recorded by fusion; () = not
    # recorded, and a strategy then takes its second check for its last)
    checks: tuple[int, ...] = ()
    # an adaptive share (QueryFocusParams.coverage): the share of chunk tokens its target wanted at
    # the last check (None: no target), and whether the cap (the ratio) held it back
    wanted_share: float | None = None
    capped: bool = False

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

    def complete_numbers(self, chosen: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
        """``chosen`` plus every token of each number one of them belongs to, sorted.

        ``chosen`` indexes ``among`` (chunk-token indices; None: all chunk tokens); only tokens of
        ``among`` can be added (at a check layer, only the active tokens have hidden states).
        """
        runs = self.number_runs
        if runs is None or chosen.numel() == 0:
            return chosen
        universe = torch.arange(self.num_chunk_tokens) if among is None else among.cpu()
        run_of = runs[universe]  # [len(universe)]
        picked = run_of[chosen.cpu()]
        picked = picked[picked >= 0].unique()
        if picked.numel() == 0:
            return chosen
        extra = torch.nonzero(torch.isin(run_of, picked)).flatten()
        return torch.unique(torch.cat([chosen.cpu(), extra]))

    def number_weight(self, boost: float, among: torch.Tensor | None = None) -> torch.Tensor | None:
        """``[len(among)]`` ``boost`` for tokens of numbers, 1 elsewhere (None: no boost or no runs)."""
        if self.number_runs is None or boost == 1.0:
            return None
        runs = self.number_runs if among is None else self.number_runs[among.cpu()]
        return torch.where(runs >= 0, boost, 1.0)

    def budget(self, share: float) -> int:
        """Number of chunk tokens a ``share`` of them is (rounded, within [0, all])."""
        return max(0, min(self.num_chunk_tokens, round(share * self.num_chunk_tokens)))

    def is_last_check(self, layer: int) -> bool:
        """Whether ``layer`` is this pass's last check layer (:attr:`checks`; when fusion did not
        record them, the second check is the last)."""
        return layer == self.checks[-1] if self.checks else len(self.deviations) > 1

    def question_importance(self, after_layer: int) -> torch.Tensor | None:
        """[chunk tokens] attention the question pays each token in the layers after ``after_layer``.

        None without a question probe (no suffix, or a strategy that asked for none).
        """
        attn = self.query_attention
        if attn is None or attn.shape[-1] != self.num_chunk_tokens:
            return None
        later = attn[after_layer + 1 :] if attn.shape[0] > after_layer + 1 else attn
        return later.sum(dim=0)

    def skip_exact_first(
        self, first_chunk_exact: bool, score: torch.Tensor, k: int, forced: torch.Tensor
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """``(score, k, forced)`` for :func:`top_indices` over all chunk tokens, with the first chunk's
        tokens out of the running when ``first_chunk_exact`` (the budget then goes to the later
        chunks); unchanged otherwise."""
        if not first_chunk_exact or not len(self.chunk_starts):
            return score, k, forced
        every = torch.arange(self.num_chunk_tokens)
        first = every < (self.chunk_starts[1] if len(self.chunk_starts) > 1 else self.num_chunk_tokens)
        score = score.clone()
        score[first] = float("-inf")
        return score, min(k, self.num_chunk_tokens - int(first.sum())), forced & ~first


def top_indices(score: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``k`` highest scores, ``forced`` ones first.

    Equal scores are picked in torch.topk's order, which is not by index (a tie at the cut takes
    any of the tied tokens); kept as is so selections stay what they were measured with.
    """
    if forced is not None and forced.any():
        score = score.clone()
        score[forced] = float("inf")
    k = min(k, score.numel())
    return torch.sort(torch.topk(score, k).indices).values if k > 0 else torch.zeros(0, dtype=torch.long)


def coverage_count(score: torch.Tensor, coverage: float, forced: torch.Tensor | None = None) -> int:
    """The fewest tokens, taken best first, whose ``score`` sums to at least ``coverage`` of the total.

    Best first is :func:`top_indices`'s order: ``forced`` tokens first, then higher scores, so the
    tokens it keeps for this count hold the mass counted. Scores are non-negative (negative ones
    count as 0); sums run in fp64 and the total is the last partial sum, so the count is exact
    against a written-out loop.

    >>> s = torch.tensor([1.0, 5.0, 3.0, 1.0])
    >>> coverage_count(s, 0.8), coverage_count(s, 0.81), coverage_count(s, 0.0)
    (2, 3, 0)
    >>> coverage_count(s, 0.5, forced=torch.tensor([True, False, False, False]))  # 1 + 5 of 10
    2
    """
    s = score.double().cpu().clamp_min(0.0)  # [n]
    if s.numel() == 0 or coverage <= 0:
        return 0
    order = torch.sort(s, descending=True, stable=True).indices
    if forced is not None and forced.any():  # forced first, each group by score
        order = order[torch.sort((~forced.cpu()[order]).to(torch.uint8), stable=True).indices]
    cum = torch.cumsum(s[order], 0)  # [n] mass of the best 1..n
    target = coverage * float(cum[-1])
    if target <= 0:
        return 0
    return min(int(torch.searchsorted(cum, torch.tensor([target], dtype=cum.dtype))[0]) + 1, s.numel())


def deviation_score(deviation: str, k_dev: torch.Tensor, v_dev: torch.Tensor) -> torch.Tensor:
    """The ranking score ``deviation`` names (``"k"``, ``"v"`` or ``"kv"``), fp32 on the host."""
    score = {"k": k_dev, "v": v_dev, "kv": k_dev + v_dev}[deviation]
    return score.float().cpu()


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
    wants_stored_scores: ClassVar[bool] = False  # it ranks by deviation recorded at index time

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

    @property
    def wants_numbers(self) -> bool:
        """Fusion fills ``SelectionState.number_runs`` for it."""
        return False

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
    """Names of the registered strategies, sorted."""
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
class Blend(Strategy):
    """CacheBlend: every token through the check layer, keep the top ``ratio`` by K/V deviation."""

    name = "blend"
    Params = BlendParams
    params: BlendParams

    def initial(self, state: SelectionState) -> torch.Tensor:
        # a budget of 0 recomputes nothing, not even the check layer: exactly naive reuse
        if state.budget(self.ratio) == 0:
            return torch.zeros(0, dtype=torch.long)
        return torch.arange(state.num_chunk_tokens)

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        return (min(self.params.check_layer, num_layers - 1),)

    def observe(
        self, state: SelectionState, layer: int, active: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor
    ) -> None:
        state.deviations[layer] = deviation_score(self.params.deviation, k_dev, v_dev)
        state.active[layer] = active.cpu()

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        return top_indices(state.deviations[layer], state.budget(min(1.0, self.ratio)))


@register_strategy
class QueryFocus(Strategy):
    """The default: rank by K/V deviation times the attention the question pays each token.

    The question is known at fusion time. A token's stale K/V can only change the answer through
    the attention the question (and answer) pay it, so the question is run through every layer
    on the naively placed cache (a few dozen tokens) and each token's attention share in the
    layers after a check layer weights its deviation there. Only the ``focus_ratio`` of tokens
    the question attends most start: layer-0 K/V depend on the token and its position only, so
    after re-rotation every cached layer-0 entry is exact and a subset can run from layer 0 alone.
    ``ratio * narrow_factor`` survive the first check layer, re-ranked at a deeper one
    (``narrow_layer``) and cut to ``ratio``: early deviation predicts deep deviation only roughly.
    Every chunk's first ``sink_tokens`` are kept whatever their score.

    With ``coverage`` > 0 the share adapts per request: the last check keeps the fewest best tokens
    holding that share of the score mass measured there, between ``min_ratio`` and ``ratio`` (now a
    cap); a target the cap cuts short is recorded on the state, and fusion reports it.
    """

    name = "query_focus"
    Params = QueryFocusParams
    params: QueryFocusParams
    wants_query_attention = True

    @property
    def wants_numbers(self) -> bool:
        return self.params.number_spans or self.params.number_boost != 1.0

    def initial(self, state: SelectionState) -> torch.Tensor:
        p = self.params
        if state.budget(self.ratio) == 0:
            return torch.zeros(0, dtype=torch.long)  # exactly naive reuse
        importance = state.question_importance(p.check_layer)
        if importance is None:  # no question: every token runs the check layers
            return torch.arange(state.num_chunk_tokens)
        share = max(p.focus_ratio, self.ratio * p.narrow_factor)
        forced = state.sink_mask(torch.arange(state.num_chunk_tokens), p.sink_tokens)
        weight = state.number_weight(p.number_boost)
        if weight is not None:
            importance = importance * weight
        chosen = top_indices(
            *state.skip_exact_first(p.first_chunk_exact, importance, state.budget(min(1.0, share)), forced)
        )
        return state.complete_numbers(chosen) if p.number_spans else chosen

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        first = min(self.params.check_layer, num_layers - 1)
        second = min(self.params.narrow_layer or max(first + 1, num_layers // 4), num_layers - 1)
        return (first, second) if second > first else (first,)

    def observe(
        self, state: SelectionState, layer: int, active: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor
    ) -> None:
        state.deviations[layer] = deviation_score(self.params.deviation, k_dev, v_dev)
        state.active[layer] = active.cpu()

    def score(self, state: SelectionState, layer: int) -> torch.Tensor:
        """[active at ``layer``] deviation weighted by the question's attention after ``layer``."""
        score = state.deviations[layer]
        everywhere = state.question_importance(layer)
        if everywhere is None:
            return score
        importance = everywhere[state.active[layer]]
        importance = importance / importance.mean().clamp_min(1e-12)
        score = score / score.mean().clamp_min(1e-12) * (importance + 1e-3).pow(self.params.query_weight)
        weight = state.number_weight(self.params.number_boost, state.active[layer])
        return score if weight is None else score * weight

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        forced = state.sink_mask(state.active[layer], self.params.sink_tokens)
        score = self.score(state, layer)
        if self.params.coverage > 0 and state.is_last_check(layer):
            k = self._covering(state, score, forced)
        else:
            first_check = len(state.deviations) == 1
            share = self.ratio * (self.params.narrow_factor if first_check else 1.0)
            k = state.budget(min(1.0, share))
        chosen = top_indices(score, k, forced)
        return state.complete_numbers(chosen, state.active[layer]) if self.params.number_spans else chosen

    def _covering(self, state: SelectionState, score: torch.Tensor, forced: torch.Tensor) -> int:
        """How many of the scored tokens the last check keeps under ``coverage``: the count the target
        wants, within [floor, cap]; what it wanted and whether the cap held it back go on ``state``."""
        cap = state.budget(min(1.0, self.ratio))
        floor = min(state.budget(self.params.min_ratio), cap)
        want = coverage_count(score, self.params.coverage, forced)
        state.wanted_share = want / max(1, state.num_chunk_tokens)
        state.capped = want > cap
        return max(floor, min(want, cap))
