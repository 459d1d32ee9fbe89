"""``plan_load``: the planner as a pure function (chunks, stored levels, sizes, rates, budget) -> choices.

A chunk can be loaded at any (codec, level) stored for it, or recomputed from its text in the
fusion pass (``TEXT``). Levels are ranked by quality, best first (``RetrieverConfig.stored_codecs``:
``codec``, then ``index_codecs`` as listed); text is the fallback ranked after every level, as in
CacheGen: it costs compute, not bytes, and is picked when no level loads faster than it computes.

Under a deadline no cap meets, a chunk can also be prefilled here (``LOCAL``): alone after the
shared prefix, as a miss is, on the caller's thread while the other chunks' bytes are still on the
wire, and then fused like a loaded chunk. Text is recomputed in the fusion pass, after every chunk
has arrived (its tokens attend to the chunks before it, so it cannot start earlier and stay exact);
a local chunk is an uncompressed cache made during the transfer, so the compute that text would
add after the load hides behind it. It ranks with text, as a fallback: a slow link can buy time
by giving fetches to the idle processor. The two paths are timed apart: the link's (reads) and
the processor's (decodes and local prefills), whichever ends last, then the fusion pass.

The plan lowers one quality cap ``r`` for all remaining chunks: at cap ``r`` each chunk takes the
first stored level at rank >= ``r`` that costs no more than recomputing it, else text. A level's
cost is the read's latency, then fetch and decode overlapped, plus the share of its tokens the
fusion pass recomputes anyway; text costs its tokens at the prefill speed. With a budget, the
smallest cap whose estimated time fits it wins (quality first); when none fits, the fastest plan
(the cheapest cap within 5% of it).
Without one, ``slack=None`` takes ``r = 0`` (the best that still beats recomputing), and a
``slack`` takes the smallest cap whose estimate is within ``(1 + slack)`` of the fastest plan's
(see docs/benchmarks.md, "Stream", for why the engine's default weighs TTFT). With a budget or
quality first, more bandwidth only makes levels faster, so it never raises the cap nor turns a
level into text: more bandwidth never lowers quality (with ``slack`` that holds for the plan's
time, not per chunk: a faster link can make one more chunk worth loading and tip the plan to a
cheaper cap). Re-planning before each chunk (on the bandwidth
measured so far) mixes levels across the prompt.

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
from typing import Final, Literal

from ragkv.types import CodecSpec

__all__ = ["LOCAL", "TEXT", "Choice", "ChunkOptions", "LoadPlan", "Rates", "choice_name", "plan_load"]

TEXT = None  # the choice "recompute this chunk from its tokens in the fusion pass"
LOCAL: Final = "local"  # the choice "prefill this chunk here, alone, while the others are fetched"
Choice = CodecSpec | Literal["local"] | None  # a stored level, LOCAL or TEXT
_NOISE = 0.05  # plans whose estimates differ by less than this share are taken as equally fast


@dataclass(frozen=True, slots=True)
class ChunkOptions:
    """What one chunk can be loaded as."""

    tokens: int  # tokens in the chunk (what recomputing it costs)
    sizes: Mapping[CodecSpec, int] = field(default_factory=dict)  # stored (codec, level) -> encoded bytes


@dataclass(frozen=True, slots=True)
class Rates:
    """The speeds a plan is made with (running estimates from real reads, decodes and prefills)."""

    transfer_bps: float  # bytes/s the chunk bytes arrive at
    recompute_tps: float  # prefill tokens/s of this model on this device (the fusion pass's marginal speed)
    # encoded bytes decoded per s, by "codec:level" (measured) or codec name (a first guess)
    decode_bps: Mapping[str, float] = field(default_factory=dict)
    latency_s: float = 0.0  # seconds per read before its first byte
    fusion_ratio: float = 0.0  # share of a loaded chunk's tokens the fusion pass still recomputes
    # decodes running at once on the loader's decode threads (busy decode seconds per second of a
    # load's decodes; 1: one after another): a decode adds its time over this to a load
    decode_overlap: float = 1.0

    def load_seconds(self, spec: CodecSpec, nbytes: int) -> float:
        """Time to have one chunk's cache: a read's latency, then fetching and decoding overlap (the
        pipelined loader)."""
        transfer = nbytes / self.transfer_bps if self.transfer_bps > 0 else float("inf")
        return self.latency_s + max(transfer, self.decode_seconds(spec, nbytes))

    def decode_seconds(self, spec: CodecSpec, nbytes: int) -> float:
        """Time decoding ``nbytes`` stored at ``spec`` adds to a load (0 while no speed is known for it):
        its time on one thread over ``decode_overlap`` (decodes running side by side each hold the
        processor for that share of their time; below 1 counts as 1)."""
        decode = self.decode_bps.get(str(spec)) or self.decode_bps.get(spec.name)
        return nbytes / decode / max(1.0, self.decode_overlap) if decode else 0.0

    def text_seconds(self, tokens: int) -> float:
        """Time to recompute one chunk from its tokens (in the fusion pass)."""
        return tokens / self.recompute_tps

    def chunk_seconds(self, spec: CodecSpec, chunk: ChunkOptions) -> float:
        """What loading ``chunk`` at ``spec`` adds to the answer: its load, and the share of its tokens
        the fusion pass recomputes anyway."""
        return self.load_seconds(spec, chunk.sizes[spec]) + self.text_seconds(chunk.tokens) * self.fusion_ratio


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Per chunk: the (codec, level) to load, ``LOCAL`` or ``TEXT``."""

    choices: tuple[Choice, ...]
    seconds: float  # estimated time to have every chunk: loads and local prefills, then recomputed text
    fits: bool  # the estimate is within the budget (always True without one)


def plan_load(
    chunks: Sequence[ChunkOptions],
    order: Sequence[CodecSpec],
    rates: Rates,
    budget_s: float | None = None,
    *,
    slack: float | None = None,
    base_s: float = 0.0,
    busy_s: float = 0.0,
) -> LoadPlan:
    """The highest-quality choice per chunk whose estimated total time fits ``budget_s``.

    Args:
        chunks: the chunks still to load, in prompt order.
        order: every stored (codec, level), best quality first.
        rates: transfer, decode and recompute speeds.
        budget_s: seconds left for loading (None: no deadline, see ``slack``).
        slack: without a deadline, how much slower than the fastest plan (a share of the answer's
            estimated time, ``base_s`` included) a better-quality plan may be and still be taken;
            None: quality first, the best that still loads faster than recomputing.
        base_s: seconds the answer costs whatever the plan (the fusion pass's fixed share).
        busy_s: seconds of work the processor already has before these chunks' (earlier chunks
            planned ``LOCAL`` and not prefilled yet).

    Returns:
        The plan. With a budget no cap meets, the same caps with chunks moved to ``LOCAL`` (the
        earliest first, while that shortens the estimate) are tried next, in cap order; when none
        fits either, the fastest of all (or the cheapest within 5% of it: estimates are not that
        exact) with ``fits=False``.
    """
    if not rates.recompute_tps > 0:
        raise ValueError(f"recompute_tps must be > 0 (prefill tokens/s); got {rates.recompute_tps!r}")
    if slack is not None and not slack >= 0:
        raise ValueError(f"slack must be >= 0 (a share of the answer's time) or None; got {slack!r}")
    if budget_s is None and slack is None:
        return _at_cap(chunks, order, rates, 0, busy_s)
    plans = [_at_cap(chunks, order, rates, cap, busy_s) for cap in range(max(len(order), 1))]
    fastest = min(plans, key=lambda p: p.seconds)
    if budget_s is None:
        assert slack is not None
        limit = (1 + slack) * (base_s + fastest.seconds) - base_s
        return next(p for p in plans if p.seconds <= limit + 1e-12)
    fitting = next((p for p in plans if p.seconds <= budget_s), None)
    if fitting is not None:
        return fitting
    plans += [_overlapped(chunks, p, rates, busy_s) for p in plans]
    fastest = min(plans, key=lambda p: p.seconds)
    fitting = next((p for p in plans if p.seconds <= budget_s), None)
    if fitting is not None:
        return fitting
    # nothing fits: the fastest plan, or a cheaper one within estimate noise of it (bytes are the surer bet)
    close = [p for p in plans if p.seconds <= (1 + _NOISE) * fastest.seconds]
    return LoadPlan(close[-1].choices, close[-1].seconds, False)


def _at_cap(
    chunks: Sequence[ChunkOptions], order: Sequence[CodecSpec], rates: Rates, cap: int, busy_s: float = 0.0
) -> LoadPlan:
    """At quality cap ``cap``: per chunk, the first stored level at rank >= cap that costs no more than
    recomputing the chunk, else text."""
    choices: list[Choice] = []
    for chunk in chunks:
        text = rates.text_seconds(chunk.tokens)
        choice: Choice = TEXT
        for spec in order[cap:]:
            if spec in chunk.sizes and rates.chunk_seconds(spec, chunk) <= text:
                choice = spec
                break
        choices.append(choice)
    return LoadPlan(tuple(choices), plan_seconds(chunks, choices, rates, busy_s), True)


def _overlapped(chunks: Sequence[ChunkOptions], plan: LoadPlan, rates: Rates, busy_s: float = 0.0) -> LoadPlan:
    """``plan`` with chunks moved to ``LOCAL``, the earliest first, while each move shortens the estimate
    (earliest: the caller prefills a local chunk when its turn comes, so the later fetches overlap it)."""
    choices = list(plan.choices)
    seconds = plan.seconds
    moved = True
    while moved:
        moved = False
        for i, choice in enumerate(choices):
            if choice == LOCAL:
                continue
            trial = [*choices[:i], LOCAL, *choices[i + 1 :]]
            trial_s = plan_seconds(chunks, trial, rates, busy_s)
            if trial_s < seconds - 1e-12:
                choices, seconds, moved = trial, trial_s, True
                break
    return LoadPlan(tuple(choices), seconds, True)


def plan_seconds(chunks: Sequence[ChunkOptions], choices: Sequence[Choice], rates: Rates, busy_s: float = 0.0) -> float:
    """Estimated seconds until every chunk is ready for the fusion pass's end: the link's reads and the
    processor's decodes and local prefills overlap (whichever ends last), then the text recomputed and
    the share of the other chunks' tokens the fusion pass recomputes anyway.

    With no ``LOCAL`` chunk (and ``busy_s`` 0, the processor's work queued before these chunks) this
    is the sum of each chunk's cost (``Rates.chunk_seconds`` or ``Rates.text_seconds``): a read's
    decode overlaps its own transfer.
    """
    link = after = 0.0
    processor = busy_s
    for chunk, choice in zip(chunks, choices, strict=True):
        text = rates.text_seconds(chunk.tokens)
        if choice is TEXT:
            after += text
        elif choice == LOCAL:
            processor += text
            after += text * rates.fusion_ratio
        else:
            assert isinstance(choice, CodecSpec)
            nbytes = chunk.sizes[choice]
            link += rates.load_seconds(choice, nbytes)
            processor += rates.decode_seconds(choice, nbytes)
            after += text * rates.fusion_ratio
    return max(link, processor) + after


def choice_name(choice: Choice) -> str:
    """``"cachegen:0"`` for a level, ``"text"`` for recompute in the fusion pass, ``"local"``."""
    return "text" if choice is None else str(choice)
