"""``LRUPolicy``: evict the least recently used entry first (the default)."""

from __future__ import annotations

from typing import Any, ClassVar

from ragkv.cache.entry_meta import EntryMeta
from ragkv.cache.policy import EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least recently stored-or-read first; the key breaks ties so the order is total.

    >>> from ragkv.cache.entry_meta import EntryMeta
    >>> old, new = EntryMeta("a", 10, 5, 1.0), EntryMeta("b", 10, 0, 2.0)
    >>> [e.key for e in LRUPolicy().eviction_order([new, old])]
    ['a', 'b']
    """

    name: ClassVar[str] = "lru"

    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        return (entry.last_access, entry.key)
