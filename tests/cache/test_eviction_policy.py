"""Eviction policies: exact orders and victim selection, the registry."""

from __future__ import annotations

import pytest

from ragkv.cache.cost import CostAwarePolicy
from ragkv.cache.entry_meta import EntryMeta
from ragkv.cache.lru import LRUPolicy
from ragkv.cache.policy import EvictionPolicy, policy_for, policy_names

ENTRIES = [
    EntryMeta("a", nbytes=100, hits=0, last_access=4.0, cost=50),  # cost score 0.5
    EntryMeta("b", nbytes=100, hits=4, last_access=1.0, cost=10),  # 0.5, older than a
    EntryMeta("c", nbytes=200, hits=1, last_access=2.0),  # no hint: cost = bytes -> 2.0
    EntryMeta("d", nbytes=50, hits=0, last_access=3.0, cost=5),  # 0.1
]


def order(policy: EvictionPolicy) -> list[str]:
    return [e.key for e in policy.eviction_order(ENTRIES)]


def test_lru_order() -> None:
    assert order(LRUPolicy()) == ["b", "c", "d", "a"]


def test_cost_aware_order() -> None:
    assert order(CostAwarePolicy()) == ["d", "b", "a", "c"]
    assert CostAwarePolicy.score(ENTRIES[2]) == 2.0


def test_victims_are_the_shortest_prefix_that_frees_enough() -> None:
    lru = LRUPolicy()
    assert [e.key for e in lru.victims(ENTRIES, 1)] == ["b"]
    assert [e.key for e in lru.victims(ENTRIES, 101)] == ["b", "c"]
    assert lru.victims(ENTRIES, 0) == []
    assert len(lru.victims(ENTRIES, 10_000)) == 4  # not enough even with all: caller refuses


def test_registry() -> None:
    assert isinstance(policy_for("lru"), LRUPolicy)
    assert isinstance(policy_for("cost"), CostAwarePolicy)
    assert policy_names() == ["cost", "lru"]
    with pytest.raises(ValueError, match=r"\['cost', 'lru'\]"):
        policy_for("random")
