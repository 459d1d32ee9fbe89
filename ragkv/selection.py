"""Which chunk tokens fusion recomputes: strategies behind one interface, chosen by name.

A strategy says which tokens start active (run through layer 0), at which layers to measure
how far the fresh K/V of the active tokens deviate from their cached K/V, and which of the
active tokens to keep running after each such check layer. Tokens kept past the last check are
recomputed through every layer; the others keep their cached K/V from there on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ragkv.fusion import FusionInput

__all__ = [
    "FusionConfig",
    "SelectionState",
    "Strategy",
    "available_strategies",
    "get_strategy",
    "register_strategy",
]


@dataclass(frozen=True, slots=True)
class FusionConfig:
    """How to fuse chunk caches. Defaults come from ``ragkv bench fusion`` (docs/benchmarks.md)."""

    method: str = "query_focus"  # strategy name, see available_strategies()
    ratio: float = 0.15  # share of chunk tokens recomputed through all layers
    check_layer: int = 1  # layer whose K/V deviation ranks tokens (layer 0 carries no signal)
    deviation: str = "v"  # "k", "v" or "kv": which deviation ranks tokens
    sink_tokens: int = 2  # first tokens of every chunk always recomputed (sink repair)
    narrow_factor: float = 2.0  # gradual: keep ratio * factor at the first check, ratio at the second
    narrow_layer: int = 0  # gradual: second check layer (0 = num_layers // 4)
    budget: float = 0.1  # budget: recompute tokens whose relative deviation exceeds this ...
    max_ratio: float = 0.5  # ... up to this share
    query_weight: float = 1.0  # query: exponent of the question-attention factor in the score
    focus_ratio: float = 0.4  # query_focus: share of tokens the question attends most that start active

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.deviation not in ("k", "v", "kv"):
            raise ValueError(f"deviation must be 'k', 'v' or 'kv', got {self.deviation!r}")
        if self.check_layer < 0 or self.sink_tokens < 0:
            raise ValueError("check_layer and sink_tokens must be >= 0")


@dataclass(slots=True)
class SelectionState:
    """What a strategy sees: the config, chunk layout and the deviations measured so far."""

    config: FusionConfig
    num_chunk_tokens: int
    chunk_starts: torch.Tensor  # [chunks] index of each chunk's first token among chunk tokens
    deviations: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> score [active]
    active: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> chunk-token indices measured
    query_attention: torch.Tensor | None = None  # [layers, chunk tokens], query-aware strategies only

    @classmethod
    def start(cls, config: FusionConfig, inp: FusionInput, n_chunk: int) -> SelectionState:
        lengths = torch.tensor([len(c) for c in inp.chunk_ids], dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths if len(lengths) else torch.zeros(0, dtype=torch.long)
        return cls(config=config, num_chunk_tokens=n_chunk, chunk_starts=starts)

    def observe(self, layer: int, active: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor) -> None:
        kind = self.config.deviation
        score = {"k": k_dev, "v": v_dev, "kv": k_dev + v_dev}[kind]
        self.deviations[layer] = score.float().cpu()
        self.active[layer] = active.cpu()

    def sink_mask(self, active: torch.Tensor) -> torch.Tensor:
        """[active] True for tokens among the first ``sink_tokens`` of their chunk."""
        if self.config.sink_tokens == 0 or len(self.chunk_starts) == 0:
            return torch.zeros(active.shape, dtype=torch.bool)
        idx = torch.searchsorted(self.chunk_starts, active.cpu(), right=True) - 1
        return (active.cpu() - self.chunk_starts[idx]) < self.config.sink_tokens

    def budget(self, share: float) -> int:
        return max(0, min(self.num_chunk_tokens, round(share * self.num_chunk_tokens)))


def _top(score: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices of the ``k`` highest scores, ``forced`` ones first (ties broken by index)."""
    if forced is not None and forced.any():
        score = score.clone()
        score[forced] = float("inf")
    k = min(k, score.numel())
    return torch.sort(torch.topk(score, k).indices).values if k > 0 else torch.zeros(0, dtype=torch.long)


class Strategy(ABC):
    """A token-selection strategy for fusion."""

    name: ClassVar[str]
    wants_query_attention: ClassVar[bool] = False

    def initial(self, state: SelectionState) -> torch.Tensor:
        """Chunk-token indices that run through layer 0 (default: all)."""
        return torch.arange(state.num_chunk_tokens)

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        """Layers after which :meth:`select` is called."""
        return (min(state.config.check_layer, num_layers - 1),)

    @abstractmethod
    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        """Indices (into the currently active tokens) to keep running after ``layer``."""


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def get_strategy(name: str) -> Strategy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown fusion method {name!r}; choose one of {sorted(_REGISTRY)}") from None


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


class _Fixed(Strategy):
    """A strategy whose tokens are fixed up front (``initial``): no check layers."""

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        return ()

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:  # pragma: no cover - no checks
        raise AssertionError(f"{self.name} has no check layers")


@register_strategy
class Naive(_Fixed):
    """Reuse chunk caches as they are (positions corrected, nothing recomputed)."""

    name = "naive"

    def initial(self, state: SelectionState) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long)


@register_strategy
class Full(_Fixed):
    """Recompute every chunk token: equals full prefill (the exactness reference)."""

    name = "full"


@register_strategy
class Sink(_Fixed):
    """EPIC: recompute only the first ``sink_tokens`` of every chunk."""

    name = "sink"

    def initial(self, state: SelectionState) -> torch.Tensor:
        every = torch.arange(state.num_chunk_tokens)
        return every[state.sink_mask(every)]


@register_strategy
class Random(_Fixed):
    """A random ``ratio`` of tokens (a control for the benchmark), seeded for repeatability."""

    name = "random"

    def initial(self, state: SelectionState) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        k = state.budget(state.config.ratio)
        return torch.sort(torch.randperm(state.num_chunk_tokens, generator=g)[:k]).values


@register_strategy
class Blend(Strategy):
    """CacheBlend: every token through the check layer, keep the top ``ratio`` by K/V deviation."""

    name = "blend"
    force_sinks: ClassVar[bool] = False

    def initial(self, state: SelectionState) -> torch.Tensor:
        # a budget of 0 recomputes nothing, not even the check layers: exactly naive reuse (sinks
        # are forced in within the budget, never on top of it)
        if state.budget(state.config.ratio) == 0:
            return torch.zeros(0, dtype=torch.long)
        return super().initial(state)

    def score(self, state: SelectionState, layer: int) -> torch.Tensor:
        """Ranking score of the tokens measured at ``layer`` (higher = recompute first)."""
        return state.deviations[layer]

    def share(self, state: SelectionState, layer: int) -> float:
        """Share of all chunk tokens to keep after ``layer``."""
        return state.config.ratio

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        active = state.active[layer]
        forced = state.sink_mask(active) if self.force_sinks else None
        return _top(self.score(state, layer), state.budget(min(1.0, self.share(state, layer))), forced)


@register_strategy
class BlendSink(Blend):
    """CacheBlend selection with every chunk's first tokens forced in (sink repair, as EPIC)."""

    name = "blend_sink"
    force_sinks = True


@register_strategy
class Gradual(Blend):
    """Keep ``ratio * narrow_factor`` at the check layer, narrow to ``ratio`` at a deeper check layer.

    Deviation at an early layer predicts deep-layer deviation only roughly; measuring again
    deeper, among a wider first cut, picks better at little extra cost.
    """

    name = "gradual"

    def check_layers(self, state: SelectionState, num_layers: int) -> tuple[int, ...]:
        first = min(state.config.check_layer, num_layers - 1)
        second = min(state.config.narrow_layer or max(first + 1, num_layers // 4), num_layers - 1)
        return (first, second) if second > first else (first,)

    def share(self, state: SelectionState, layer: int) -> float:
        first_check = len(state.deviations) == 1
        return state.config.ratio * (state.config.narrow_factor if first_check else 1.0)


@register_strategy
class QueryAware(BlendSink):
    """Ours: rank by K/V deviation times the attention the question pays each token in later layers.

    The question is known at fusion time. A token's stale K/V can only change the answer through
    the attention the question (and answer) pay it, so the question is run through every layer
    on the naively placed cache (a few dozen tokens, ~1% of a prefill) and each token's attention
    share in the layers after the check layer weights its deviation.
    """

    name = "query"
    wants_query_attention = True

    def score(self, state: SelectionState, layer: int) -> torch.Tensor:
        score = state.deviations[layer]
        everywhere = _question_importance(state, layer)
        if everywhere is None:
            return score
        importance = everywhere[state.active[layer]]
        importance = importance / importance.mean().clamp_min(1e-12)
        return score / score.mean().clamp_min(1e-12) * (importance + 1e-3).pow(state.config.query_weight)


@register_strategy
class QueryGradual(QueryAware, Gradual):
    """Query-aware scores with gradual narrowing (a wide first cut, re-ranked deeper)."""

    name = "query_gradual"


@register_strategy
class Budget(Strategy):
    """Ours: recompute every token whose relative deviation exceeds ``budget`` (up to ``max_ratio``).

    A quality bound instead of a fixed ratio: prompts whose chunks barely interact cost little.
    """

    name = "budget"

    def select(self, state: SelectionState, layer: int) -> torch.Tensor:
        score = state.deviations[layer]
        active = state.active[layer]
        over = int((score > state.config.budget).sum())
        k = min(over, state.budget(state.config.max_ratio))
        return _top(score, k, state.sink_mask(active))


def _question_importance(state: SelectionState, after_layer: int) -> torch.Tensor | None:
    """[chunk tokens] attention the question pays each token in the layers after ``after_layer``."""
    attn = state.query_attention
    if attn is None or attn.shape[-1] != state.num_chunk_tokens:
        return None
    later = attn[after_layer + 1 :] if attn.shape[0] > after_layer + 1 else attn
    return later.sum(dim=0)


@register_strategy
class QueryAttention(_Fixed):
    """Recompute the ``ratio`` of tokens the question attends most; no check layers.

    Every chunk's first ``sink_tokens`` come first within that budget. Without a question (no
    suffix) it recomputes those first tokens only, as ``sink`` does.
    """

    name = "query_attn"
    wants_query_attention = True

    def initial(self, state: SelectionState) -> torch.Tensor:
        every = torch.arange(state.num_chunk_tokens)
        importance = _question_importance(state, state.config.check_layer)
        if importance is None:  # no question: what `sink` recomputes
            return Sink().initial(state)
        return _top(importance, state.budget(state.config.ratio), state.sink_mask(every))


@register_strategy
class QueryFocus(QueryGradual):
    """Ours, cheaper: only the ``focus_ratio`` of tokens the question attends most run the check layers.

    Layer-0 K/V depend on the token and its position only, so after re-rotation every cached
    layer-0 entry is exact and a subset of tokens can run from layer 0 without the others. Tokens
    the question barely attends cannot change the answer much, so skipping their check layers
    loses little and saves most of the two full-width layers query_gradual pays for.
    """

    name = "query_focus"

    def initial(self, state: SelectionState) -> torch.Tensor:
        every = torch.arange(state.num_chunk_tokens)
        importance = _question_importance(state, state.config.check_layer)
        share = max(state.config.focus_ratio, state.config.ratio * state.config.narrow_factor)
        if importance is None or state.budget(state.config.ratio) == 0:
            return super().initial(state)  # no question: query_gradual's; budget 0: naive
        return _top(importance, state.budget(min(1.0, share)), state.sink_mask(every))
