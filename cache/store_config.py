"""``StoreConfig``: how a ``TieredStore`` treats its tiers."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreConfig"]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of a TieredStore (the tiers' own settings live in their URLs)."""

    promote: bool = True  # copy a hit from a lower tier into the writable tiers above it
    breaker_failures: int = 3  # consecutive failures after which a tier is skipped
    breaker_cooldown_s: float = 30.0  # seconds a failing tier is skipped before one probe call
    workers_per_tier: int = 4  # threads that run one tier's calls under its timeout
    quarantine_size: int = 4096  # invalidated keys remembered for tiers that could not delete them

    def __post_init__(self) -> None:
        if self.breaker_failures < 1 or self.breaker_cooldown_s < 0:
            raise ValueError("breaker_failures must be >= 1 and breaker_cooldown_s >= 0")
        if self.workers_per_tier < 1 or self.quarantine_size < 0:
            raise ValueError("workers_per_tier must be >= 1 and quarantine_size >= 0")
