"""One answer's load: re-plans before each chunk on the speeds measured so far, and reports.

``LoadEstimates`` lives as long as the engine: running estimates of prefill tokens/s, of the
fusion pass's fixed cost and of each stored level's decode speed (the store keeps each tier's read
latency and speed; ``ragkv.planner.ratebook`` carries all of them to the next process).
``LoadSession`` is one query's load: the retriever asks it, chunk by chunk and just before
fetching, what to load; tells it what each fetch and decode cost; and stops asking once a tier
fails mid-load (the rest become text). On a cold start (a remote tier never measured, nothing
seeded) its first chunk is a probe: the smallest stored level, whose read measures the link
before the rest is planned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.cache.fetched import Fetched
from ragkv.cache.link import LinkEstimate
from ragkv.planner.config import LoadConfig
from ragkv.planner.plan import LOCAL, TEXT, Choice, ChunkOptions, Rates, choice_name, plan_load
from ragkv.planner.throughput import RateEstimate
from ragkv.types import CodecSpec

__all__ = ["Average", "LoadEstimates", "LoadPlanning", "LoadSession"]

# First guesses of decode speed (encoded bytes/s on CPU; docs/benchmarks.md), until measured.
_FIRST_DECODE_BPS = {"raw": 2e9, "int8": 4e8, "int4": 3e8, "cachegen": 6e7}
_UNKNOWN_DECODE_BPS = 1e8


class Average:
    """An exponentially weighted moving average of seconds (a fixed cost). Thread-safe."""

    def __init__(self, first: float, weight: float = 0.3) -> None:
        self.value, self.weight, self.samples = float(first), weight, 0
        self._lock = threading.Lock()

    def seed(self, seconds: float) -> None:
        """Start from an earlier measurement (another process's); counts as one."""
        with self._lock:
            self.value, self.samples = float(seconds), max(self.samples, 1)

    def observe(self, seconds: float) -> None:
        """Take one measurement (ignored unless finite and >= 0)."""
        if not 0 <= seconds < float("inf"):
            return
        with self._lock:
            self.value += self.weight * (seconds - self.value)
            self.samples += 1


class LoadEstimates:
    """Running estimates an engine keeps across answers.

    ``recompute``: the fusion pass's marginal prefill speed (tokens/s), measured on full prefills and
    on fusion passes that compute most of the prompt; ``fusion_fixed``: what a fusion pass costs on
    top (seconds: placing the chunks, the question probe, attention over the loaded tokens),
    measured on every fusion pass; ``decode(spec)``: encoded bytes/s per stored level, each decode
    timed on its own thread; ``decode_overlap``: how many decodes run at once on the loader's decode
    threads (their busy seconds per second of a load's decodes, from 1: one thread).
    """

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config or LoadConfig()
        self.recompute = RateEstimate(self.config.recompute_tps, self.config.weight)  # tokens/s
        self.fusion_fixed = Average(0.0, self.config.weight)  # seconds per fusion pass
        self._decode: dict[str, RateEstimate] = {}
        self.decode_overlap = RateEstimate(1.0, self.config.weight)  # decodes at once
        self._lock = threading.Lock()
        self.last_tier: str | None = None  # the tier that served the last chunk read

    def decode(self, codec: str) -> RateEstimate:
        """The decode speed estimate of ``codec`` (encoded bytes/s), a stored level ``"cachegen:2"``
        (its first guess is its codec's) or a codec name."""
        with self._lock:
            if codec not in self._decode:
                name = codec.split(":", 1)[0]
                first = _FIRST_DECODE_BPS.get(name, _UNKNOWN_DECODE_BPS)
                self._decode[codec] = RateEstimate(first, self.config.weight)
            return self._decode[codec]

    def decode_rates(self) -> dict[str, float]:
        """The decode speeds measured (or seeded) so far, by stored level or codec."""
        with self._lock:
            return {key: est.rate for key, est in self._decode.items() if est.samples > 0}

    def observe_prefill(self, computed: int, total: int, seconds: float) -> None:
        """Record a prefill or fusion pass: ``computed`` of its ``total`` tokens went through every layer
        in ``seconds``. The marginal speed is taken from passes that compute most of the prompt (and,
        until one is seen, from the first pass of any kind: a low bound, which errs towards loading
        rather than recomputing); the fixed cost is what each pass took beyond its tokens at that speed."""
        if computed <= 0 or seconds <= 0:
            return
        if 2 * computed >= total or self.recompute.samples == 0:
            self.recompute.observe(computed, seconds)
        self.fusion_fixed.observe(max(0.0, seconds - self.recompute.seconds(computed)))


@dataclass(slots=True)
class LoadPlanning:
    """What the engine hands the loader for one answer (the loader returns its report beside the chunks)."""

    config: LoadConfig
    estimates: LoadEstimates
    deadline: float | None = None  # time.perf_counter() value by which loading must be done
    reserve_s: float = 0.0  # estimated seconds the fusion pass needs after loading
    fusion_ratio: float = 0.0  # share of a loaded chunk's tokens the fusion pass recomputes


class LoadSession:
    """Plans one answer's chunk loads as they happen.

    Args:
        chunks: per chunk (in load order), its token count and stored sizes; a chunk with no stored
            size is not planned (it is loaded at the primary codec, or computed and stored on a miss).
        order: every stored (codec, level), best quality first.
        estimates: the engine's running estimates.
        links: the store's read estimates per tier (``TieredStore.read_estimates``).
        deadline: ``time.perf_counter()`` value by which loading must be done; None: no deadline.
        reserve_s: estimated seconds the fusion pass needs after loading (subtracted from the budget).
        fusion_ratio: share of a loaded chunk's tokens the fusion pass recomputes anyway.
        slack: without a deadline, the TTFT share traded for quality (``LoadConfig.ttft_slack``).
        decode_workers: the loader's decode threads: a plan counts at most that many decodes at once
            (the overlap measured, or read back, with more threads does not apply to fewer).
    """

    def __init__(
        self,
        chunks: Sequence[ChunkOptions],
        order: Sequence[CodecSpec],
        estimates: LoadEstimates,
        links: Callable[[], Mapping[str, LinkEstimate]],
        *,
        deadline: float | None = None,
        reserve_s: float = 0.0,
        fusion_ratio: float = 0.0,
        slack: float | None = None,
        decode_workers: int = 1,
    ) -> None:
        self.chunks, self.order, self.estimates = list(chunks), list(order), estimates
        self.decode_workers = decode_workers
        self._links, self.deadline, self.reserve_s = links, deadline, reserve_s
        self.fusion_ratio, self.slack = fusion_ratio, slack
        self.probed: int | None = None  # the chunk loaded at its smallest level to measure an unmeasured link
        self.choices: list[str] = ["" for _ in self.chunks]  # what each chunk was loaded as
        self.bytes_by_tier: dict[str, int] = {}
        self.bandwidth_bps: list[float] = []  # the transfer estimate each plan used
        self.broken = False  # a tier failed mid-load: every later chunk is recomputed from text
        # chunks planned LOCAL and not prefilled yet -> estimated seconds (planned on the fetch thread,
        # prefilled on the caller's: hence the lock)
        self._queued: dict[int, float] = {}
        self._queued_lock = threading.Lock()
        self._tier: str | None = estimates.last_tier

    def choose(self, n: int) -> Choice:
        """What to load chunk ``n`` as (re-planning chunks ``n..``): a stored level, ``LOCAL`` or ``TEXT``."""
        if self.broken:
            return TEXT
        link = self.link()
        rates = self.rates(link)
        self.bandwidth_bps.append(rates.transfer_bps)
        if not link.measured and self.probed is None and self.chunks[n].sizes and len(self.chunks) - n > 1:
            # nothing known of this link: load this chunk at its smallest level, which measures it
            self.probed = n
            return min(self.chunks[n].sizes, key=lambda spec: self.chunks[n].sizes[spec])
        budget = None if self.deadline is None else self.deadline - time.perf_counter() - self.reserve_s
        with self._queued_lock:
            busy = sum(self._queued.values())  # the caller's thread still has these prefills to do
        plan = plan_load(
            self.chunks[n:], self.order, rates, budget, slack=self.slack, base_s=self.reserve_s, busy_s=busy
        )
        if plan.choices[0] == LOCAL:
            with self._queued_lock:
                self._queued[n] = rates.text_seconds(self.chunks[n].tokens)
        return plan.choices[0]

    def link(self) -> LinkEstimate:
        """The read estimate of the tier that served this load's last read (before any, the last
        answer's; before that, the slowest tier's)."""
        tiers = self._links()
        slowest = min(tiers.values(), key=lambda est: est.rate)
        return tiers.get(self._tier, slowest) if self._tier else slowest

    def rates(self, link: LinkEstimate | None = None) -> Rates:
        """The speeds known now (``link``: the tier estimate to plan on; default :meth:`link`)."""
        link = link or self.link()
        decode = {str(spec): self.estimates.decode(str(spec)).rate for spec in self.order}
        overlap = min(self.estimates.decode_overlap.rate, float(self.decode_workers))
        return Rates(link.rate, self.estimates.recompute.rate, decode, link.latency, self.fusion_ratio, overlap)

    def fetched(self, n: int, spec: CodecSpec, got: Fetched) -> bool:
        """Record chunk ``n``'s fetch at ``spec``; False if a tier failed and it must be recomputed."""
        if got.value is None:
            if got.failed and self.chunks[n].sizes:
                self.broken = True  # stored but unreachable: the link is gone, do not wait on it again
                self.choices[n] = "text"
                return False
            self.choices[n] = "computed"
            return True
        self.choices[n] = choice_name(spec)
        if got.tier is not None:
            self._tier = self.estimates.last_tier = got.tier
            self.bytes_by_tier[got.tier] = self.bytes_by_tier.get(got.tier, 0) + len(got.value)
        return True

    def decoded(self, spec: CodecSpec, nbytes: int, seconds: float) -> None:
        """Record a decode's cost."""
        self.estimates.decode(str(spec)).observe(nbytes, seconds)

    def decodes_overlapped(self, spans: Sequence[tuple[float, float]]) -> None:
        """Record how the load's decodes on several threads overlapped: ``spans`` are their
        ``(start, end)`` times. Their busy seconds over the seconds from the first start to the last
        end, at least 1 (decodes starved by their fetches overlap less than they could: a plan then
        counts them as one after another, as with one thread)."""
        if len(spans) < 2:
            return
        busy = sum(end - start for start, end in spans)
        wall = max(end for _, end in spans) - min(start for start, _ in spans)
        if wall > 0:
            self.estimates.decode_overlap.observe(max(busy, wall), wall)

    def prefilled_here(self, n: int, tokens: int, seconds: float) -> None:
        """Record that chunk ``n`` (planned ``LOCAL``) was prefilled here: ``tokens`` in ``seconds``, a
        measurement of the prefill speed (the fusion pass's fixed cost is not in it)."""
        self.choices[n] = LOCAL
        with self._queued_lock:
            self._queued.pop(n, None)
        self.estimates.recompute.observe(tokens, seconds)

    def recomputed(self, n: int) -> None:
        """Record that chunk ``n`` is recomputed from its text (planned, or its tier failed)."""
        self.choices[n] = "text"

    def report(self) -> dict[str, Any]:
        """The per-answer stats: choice per chunk, bytes per tier, the bandwidth estimate used."""
        bw = self.bandwidth_bps
        return {
            "choices": list(self.choices),
            "bytes_by_tier": dict(self.bytes_by_tier),
            "bandwidth_mbit": round(bw[0] * 8 / 1e6, 3) if bw else None,  # the first plan's estimate
            "bandwidth_mbit_last": round(bw[-1] * 8 / 1e6, 3) if bw else None,
            "tier_failed": self.broken,
            "probe": self.probed,  # the chunk loaded at its smallest level to measure the link (None: none)
        }
