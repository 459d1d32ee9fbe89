"""``plan_load``: the planner as a pure function (chunks, stored levels, sizes, rates, budget) -> choices.

A chunk can be loaded at any (codec, level) stored for it, or recomputed from its text in the
fusion pass (``TEXT``). Levels are ranked by quality, best first (``RetrieverConfig.stored_codecs``:
``codec``, then ``index_codecs`` as listed); text is the fallback ranked after every level, as in
CacheGen: it costs compute, not bytes, and is picked when no level loads faster than it computes.

The plan lowers one quality cap ``r`` for all remaining chunks: at cap ``r`` each chunk takes the
first stored level at rank >= ``r`` that loads no slower than its text recomputes, else text. The
smallest cap whose estimated time fits the budget wins (with no budget: ``r = 0``). Because more
bandwidth only makes levels faster, it never raises the cap nor turns a level into text: more
bandwidth never lowers quality. Re-planning before each chunk (on the bandwidth measured so far)
mixes levels across the prompt.

>>> from ragkv.types import CodecSpec
>>> best, cheap = CodecSpec("cachegen", 0), CodecSpec("cachegen", 3)
>>> chunk = ChunkOptions(tokens=400, sizes={best: 2_000_000, cheap: 500_000})
>>> rates = Rates(transfer_bps=125e6, recompute_tps=1000.0)  # 1 Gbit/s; 0.4 s to recompute
>>> plan_load([chunk], [best, cheap], rates).choices
(CodecSpec(name='cachegen', level=0),)
>>> plan_load([chunk], [best, cheap], rates, budget_s=0.01).choices  # best takes 16 ms
(CodecSpec(name='cachegen', level=3),)
>>> plan_load([chunk], [best, cheap], Rates(transfer_bps=2.5e6, recompute_tps=1000.0)).choices  # 20 Mbit/s
(CodecSpec(name='cachegen', level=3),)
>>> plan_load([chunk], [best, cheap], Rates(transfer_bps=1e6, recompute_tps=1000.0)).choices  # 8 Mbit/s
(None,)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ragkv.types import CodecSpec

__all__ = ["TEXT", "ChunkOptions", "LoadPlan", "Rates", "choice_name", "plan_load"]

TEXT = None  # the choice "recompute this chunk from its tokens"


@dataclass(frozen=True, slots=True)
class ChunkOptions:
    """What one chunk can be loaded as."""

    tokens: int  # tokens in the chunk (what recomputing it costs)
    sizes: Mapping[CodecSpec, int] = field(default_factory=dict)  # stored (codec, level) -> encoded bytes


@dataclass(frozen=True, slots=True)
class Rates:
    """The speeds a plan is made with (running estimates from real reads, decodes and prefills)."""

    transfer_bps: float  # bytes/s the chunk bytes arrive at
    recompute_tps: float  # prefill tokens/s of this model on this device
    decode_bps: Mapping[str, float] = field(default_factory=dict)  # codec name -> encoded bytes decoded per s

    def load_seconds(self, spec: CodecSpec, nbytes: int) -> float:
        """Time to have one chunk's cache: fetching and decoding overlap (the pipelined loader)."""
        transfer = nbytes / self.transfer_bps if self.transfer_bps > 0 else float("inf")
        decode = self.decode_bps.get(spec.name)
        return max(transfer, nbytes / decode if decode else 0.0)

    def text_seconds(self, tokens: int) -> float:
        """Time to recompute one chunk from its tokens."""
        return tokens / self.recompute_tps


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Per chunk: the (codec, level) to load, or ``TEXT``."""

    choices: tuple[CodecSpec | None, ...]
    seconds: float  # estimated time to load or recompute every chunk, one after the other
    fits: bool  # the estimate is within the budget (always True without one)


def plan_load(
    chunks: Sequence[ChunkOptions], order: Sequence[CodecSpec], rates: Rates, budget_s: float | None = None
) -> LoadPlan:
    """The highest-quality choice per chunk whose estimated total time fits ``budget_s``.

    Args:
        chunks: the chunks still to load, in prompt order.
        order: every stored (codec, level), best quality first.
        rates: transfer, decode and recompute speeds.
        budget_s: seconds left for loading (None: no deadline, only "faster than recomputing").

    Returns:
        The plan; when even the cheapest plan misses the budget, that plan with ``fits=False``.
    """
    if not rates.recompute_tps > 0:
        raise ValueError(f"recompute_tps must be > 0 (prefill tokens/s); got {rates.recompute_tps!r}")
    last = max(len(order) - 1, 0)
    for cap in range(last + 1 if budget_s is not None else 1):
        plan = _at_cap(chunks, order, rates, cap)
        if budget_s is None or plan.seconds <= budget_s:
            return plan
    cheapest = _at_cap(chunks, order, rates, last)
    return LoadPlan(cheapest.choices, cheapest.seconds, False)


def _at_cap(chunks: Sequence[ChunkOptions], order: Sequence[CodecSpec], rates: Rates, cap: int) -> LoadPlan:
    choices: list[CodecSpec | None] = []
    total = 0.0
    for chunk in chunks:
        text = rates.text_seconds(chunk.tokens)
        best: tuple[CodecSpec | None, float] = (TEXT, text)
        for spec in order[cap:]:
            if spec in chunk.sizes:
                seconds = rates.load_seconds(spec, chunk.sizes[spec])
                if seconds <= text:
                    best = (spec, seconds)
                    break
        choices.append(best[0])
        total += best[1]
    return LoadPlan(tuple(choices), total, True)


def choice_name(choice: CodecSpec | None) -> str:
    """``"cachegen:0"`` for a level, ``"text"`` for recompute."""
    return "text" if choice is None else str(choice)
