"""``CostAwarePolicy``: keep what is reused most and costs most to recompute per stored byte."""

from __future__ import annotations

from typing import Any, ClassVar

from ragkv.cache.entry_meta import EntryMeta
from ragkv.cache.policy import EvictionPolicy

__all__ = ["CostAwarePolicy"]


class CostAwarePolicy(EvictionPolicy):
    """Cache-Craft's value per byte: evict the lowest ``(hits + 1) * cost / nbytes`` first.

    ``cost`` is the recompute-cost hint given to ``put`` (e.g. the chunk's token count), or the
    entry's size when none was given. The ``+ 1`` counts the store itself as a use: with plain
    ``hits`` every fresh entry scores 0 and is evicted before it can be reused, whatever it
    costs. Ties go to the least recently used.

    >>> from ragkv.cache.entry_meta import EntryMeta
    >>> cheap = EntryMeta("cheap", nbytes=100, hits=3, last_access=1.0, cost=10)
    >>> dear = EntryMeta("dear", nbytes=100, hits=0, last_access=0.0, cost=400)
    >>> [e.key for e in CostAwarePolicy().eviction_order([dear, cheap])]
    ['cheap', 'dear']
    """

    name: ClassVar[str] = "cost"

    @staticmethod
    def score(entry: EntryMeta) -> float:
        """Reuse-weighted recompute cost per stored byte; higher is kept longer."""
        return (entry.hits + 1) * entry.effective_cost / max(entry.nbytes, 1)

    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        return (self.score(entry), entry.last_access, entry.key)
