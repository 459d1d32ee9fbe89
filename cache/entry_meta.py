"""``EntryMeta``: what an eviction policy knows about one stored entry."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EntryMeta"]


@dataclass(frozen=True, slots=True)
class EntryMeta:
    """One entry as eviction policies see it (never the value itself)."""

    key: str  # storage key "<namespace>/<digest>"
    nbytes: int  # value size in bytes
    hits: int  # reads since the entry was stored
    last_access: float  # when it was last stored or read; only the order matters
    cost: float | None = None  # recompute-cost hint given to put (e.g. tokens); None: unknown

    @property
    def effective_cost(self) -> float:
        """The cost hint, or ``nbytes`` when none was given.

        Recompute cost grows with a chunk's tokens and so does its size, so without a hint the
        cost-aware score reduces to hit count.
        """
        return float(self.nbytes) if self.cost is None else float(self.cost)
