"""One answer's load: re-plans before each chunk on the speeds measured so far, and reports.

``LoadEstimates`` lives as long as the engine: running estimates of prefill tokens/s and of each
codec's decode speed (the store keeps each tier's read speed). ``LoadSession`` is one query's
load: the retriever asks it, chunk by chunk and just before fetching, what to load; tells it what
each fetch and decode cost; and stops asking once a tier fails mid-load (the rest become text).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.cache.fetched import Fetched
from ragkv.cache.throughput import RateEstimate
from ragkv.planner.config import LoadConfig
from ragkv.planner.plan import TEXT, ChunkOptions, Rates, choice_name, plan_load
from ragkv.types import CodecSpec

__all__ = ["LoadEstimates", "LoadPlanning", "LoadSession"]

# First guesses of decode speed (encoded bytes/s on CPU; docs/benchmarks.md), until measured.
_FIRST_DECODE_BPS = {"raw": 2e9, "int8": 4e8, "int4": 3e8, "cachegen": 6e7}
_UNKNOWN_DECODE_BPS = 1e8


class LoadEstimates:
    """Running estimates an engine keeps across answers: prefill tokens/s, decode bytes/s per codec."""

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config or LoadConfig()
        self.recompute = RateEstimate(self.config.recompute_tps, self.config.weight)  # tokens/s
        self._decode: dict[str, RateEstimate] = {}
        self._lock = threading.Lock()
        self.last_tier: str | None = None  # the tier that served the last chunk read

    def decode(self, codec: str) -> RateEstimate:
        """The decode speed estimate of ``codec`` (encoded bytes/s)."""
        with self._lock:
            if codec not in self._decode:
                first = _FIRST_DECODE_BPS.get(codec, _UNKNOWN_DECODE_BPS)
                self._decode[codec] = RateEstimate(first, self.config.weight)
            return self._decode[codec]


@dataclass(slots=True)
class LoadPlanning:
    """What the engine hands the loader for one answer; the loader fills ``report``."""

    config: LoadConfig
    estimates: LoadEstimates
    deadline: float | None = None  # time.perf_counter() value by which loading must be done
    reserve_s: float = 0.0  # estimated seconds the fusion pass needs after loading
    report: dict[str, Any] | None = None  # LoadSession.report() once loaded


class LoadSession:
    """Plans one answer's chunk loads as they happen.

    Args:
        chunks: per chunk (in load order), its token count and stored sizes; a chunk with no stored
            size is not planned (it is loaded at the primary codec, or computed and stored on a miss).
        order: every stored (codec, level), best quality first.
        estimates: the engine's running estimates.
        read_rates: the store's current read speed per tier (``TieredStore.read_rates``).
        deadline: ``time.perf_counter()`` value by which loading must be done; None: no deadline.
        reserve_s: estimated seconds the fusion pass needs after loading (subtracted from the budget).
    """

    def __init__(
        self,
        chunks: Sequence[ChunkOptions],
        order: Sequence[CodecSpec],
        estimates: LoadEstimates,
        read_rates: Callable[[], Mapping[str, float]],
        *,
        deadline: float | None = None,
        reserve_s: float = 0.0,
    ) -> None:
        self.chunks, self.order, self.estimates = list(chunks), list(order), estimates
        self._read_rates, self.deadline, self.reserve_s = read_rates, deadline, reserve_s
        self.choices: list[str] = ["" for _ in self.chunks]  # what each chunk was loaded as
        self.bytes_by_tier: dict[str, int] = {}
        self.bandwidth_bps: list[float] = []  # the transfer estimate each plan used
        self.broken = False  # a tier failed mid-load: every later chunk is recomputed from text
        self._tier: str | None = estimates.last_tier

    def choose(self, n: int) -> CodecSpec | None:
        """What to load chunk ``n`` as (re-planning chunks ``n..``), or ``TEXT``."""
        if self.broken:
            return TEXT
        rates = self.rates()
        budget = None if self.deadline is None else self.deadline - time.perf_counter() - self.reserve_s
        plan = plan_load(self.chunks[n:], self.order, rates, budget)
        self.bandwidth_bps.append(rates.transfer_bps)
        return plan.choices[0]

    def rates(self) -> Rates:
        """The speeds known now: the read speed of the tier that served this load's last read (before
        any, the last answer's; before that, the slowest tier's)."""
        tiers = self._read_rates()
        transfer = tiers.get(self._tier, min(tiers.values())) if self._tier else min(tiers.values())
        decode = {spec.name: self.estimates.decode(spec.name).rate for spec in self.order}
        return Rates(transfer, self.estimates.recompute.rate, decode)

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
        self.estimates.decode(spec.name).observe(nbytes, seconds)

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
        }
