"""``Fetched``: what one store read found, and how the read went."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fetched"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one :meth:`TieredStore.fetch` found, and how the read went."""

    value: bytes | None  # the bytes, or None (not stored, or every tier holding it failed)
    tier: str | None  # the label (as in stats()) of the tier that served it; None on a miss
    seconds: float  # wall time of the tier call that served it (0.0 on a miss)
    failed: bool  # some tier failed, timed out or was skipped during this read
