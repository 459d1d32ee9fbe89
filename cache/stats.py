"""``TierStats``: a snapshot of one tier's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TierStats"]


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since it was opened in this process, plus its current usage.

    ``entries`` and ``bytes_stored`` are None for tiers that cannot tell without a scan
    (Redis, object storage).
    """

    hits: int = 0  # get/get_many lookups that found a value
    misses: int = 0  # lookups that found nothing
    bytes_in: int = 0  # value bytes written by put
    bytes_out: int = 0  # value bytes returned by get/get_many
    evictions: int = 0  # entries removed to make room (not deletes, not expiry)
    errors: int = 0  # calls that failed or timed out (the tier was down, slow or full)
    refused: int = 0  # puts a writable tier declined (over max_bytes/tenant_max_bytes, disk full)
    entries: int | None = None  # entries stored now, all namespaces
    bytes_stored: int | None = None  # value bytes stored now, all namespaces

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (for JSON and tables)."""
        return asdict(self)
