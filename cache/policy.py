"""``EvictionPolicy``: which entries a full tier gives up first, and the policy registry.

A policy only orders entries; tiers decide when to evict, within one tenant's namespace.
Policies are named in tier URLs (``policy=lru``, ``policy=cost``) and looked up here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from ragkv.cache._lazy import load_target
from ragkv.cache.entry_meta import EntryMeta

__all__ = ["EvictionPolicy", "policy_for", "register_policy", "policy_names"]

_POLICIES: dict[str, str | type[EvictionPolicy]] = {
    "lru": "ragkv.cache.lru:LRUPolicy",
    "cost": "ragkv.cache.cost:CostAwarePolicy",
}


class EvictionPolicy(ABC):
    """Orders entries for eviction: the first in :meth:`eviction_order` goes first."""

    name: ClassVar[str]

    @abstractmethod
    def sort_key(self, entry: EntryMeta) -> tuple[Any, ...]:
        """A key that sorts the entry to evict first lowest. Must be total (no ties)."""

    def eviction_order(self, entries: Iterable[EntryMeta]) -> list[EntryMeta]:
        """``entries`` sorted so that the first is the first to evict."""
        return sorted(entries, key=self.sort_key)

    def victims(self, entries: Iterable[EntryMeta], bytes_to_free: int) -> list[EntryMeta]:
        """The shortest prefix of the eviction order that frees at least ``bytes_to_free``.

        Returns every entry when even all of them do not free enough; the caller then refuses
        the write instead of evicting.
        """
        chosen: list[EntryMeta] = []
        freed = 0
        for entry in self.eviction_order(entries):
            if freed >= bytes_to_free:
                break
            chosen.append(entry)
            freed += entry.nbytes
        return chosen


def register_policy(name: str, policy: type[EvictionPolicy] | str) -> None:
    """Make ``policy=name`` in tier URLs select ``policy`` (a class or ``"module:Class"``)."""
    _POLICIES[name] = policy


def policy_names() -> list[str]:
    """The registered policy names."""
    return sorted(_POLICIES)


def policy_for(name: str) -> EvictionPolicy:
    """A new instance of the policy registered as ``name``.

    Raises:
        ValueError: no such policy.
    """
    try:
        target = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {policy_names()}") from None
    cls = load_target(target) if isinstance(target, str) else target
    policy: EvictionPolicy = cls()
    return policy
