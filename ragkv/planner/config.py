"""``LoadConfig``: how chunk caches are loaded on the query path."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.types import CodecSpec

__all__ = ["LoadConfig"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Load planning settings. Defaults: no deadline, plan every load (see ``ragkv.planner``)."""

    slo_ms: float | None = None  # TTFT deadline; None: best quality that still loads faster than recomputing
    fixed: CodecSpec | None = None  # load this stored (codec, level) for every chunk, no planning; None: plan
    recompute_tps: float = 1000.0  # first guess of prefill tokens/s, until a prefill is measured
    weight: float = 0.3  # how far each measurement moves the running estimates (0..1]
    # no deadline: the best quality whose estimated TTFT is within this share of the fastest plan's;
    # None: the best quality that still loads faster than recomputing (docs/benchmarks.md, "Stream")
    ttft_slack: float | None = 0.05
    persist: bool = True  # keep measured speeds in <data_dir>/load_rates.json for the next process

    def __post_init__(self) -> None:
        if self.slo_ms is not None and (isinstance(self.slo_ms, bool) or not self.slo_ms > 0):
            raise ValueError(f"slo_ms must be a positive number of milliseconds (or None); got {self.slo_ms!r}")
        if self.fixed is not None and not isinstance(self.fixed, CodecSpec):
            raise TypeError("fixed takes a CodecSpec, e.g. CodecSpec('cachegen', 1), or None to plan")
        if not self.recompute_tps > 0:
            raise ValueError(f"recompute_tps must be > 0 (tokens/s); got {self.recompute_tps!r}")
        if self.ttft_slack is not None and (isinstance(self.ttft_slack, bool) or not self.ttft_slack >= 0):
            raise ValueError(f"ttft_slack must be >= 0 (e.g. 0.05 for 5%) or None; got {self.ttft_slack!r}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1]; got {self.weight!r}")
