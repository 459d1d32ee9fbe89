"""MemoryTier: exact eviction order (LRU and cost-aware), budgets, tenant isolation, threads."""

from __future__ import annotations

import threading

import pytest

from ragkv.cache.memory import MemoryTier
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import make_key


def keys_of(tier: MemoryTier, tenant: str = "default") -> set[str]:
    return set(tier.keys(tenant_namespace(tenant)))


def test_lru_evicts_least_recently_used_first_in_exact_order() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=400")
    a, b, c, d, e, f = (make_key(x) for x in "abcdef")
    for key in (a, b, c, d):
        assert tier.put(key, b"x" * 100)
    tier.get(a)  # order of use now: b, c, d, a
    evicted = []
    for key in (e, f):
        before = keys_of(tier)
        assert tier.put(key, b"y" * 100)
        evicted += sorted(before - keys_of(tier))
    assert evicted == [b, c]
    assert keys_of(tier) == {d, a, e, f}
    assert tier.stats().evictions == 2


def test_lru_evicts_as_many_as_needed_for_a_big_value() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=400")
    a, b, c, d, big = (make_key(x) for x in ("a", "b", "c", "d", "big"))
    for key in (a, b, c, d):
        tier.put(key, b"x" * 100)
    tier.get(a)
    assert tier.put(big, b"z" * 250)  # needs 250 bytes: b, c, d go (oldest first), a stays
    assert keys_of(tier) == {a, big}
    assert tier.stats().bytes_stored == 350


def test_cost_aware_evicts_lowest_reuse_times_cost_per_byte_in_exact_order() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=900&policy=cost")  # full after these five
    k = {name: make_key(name) for name in ("cheap", "hot", "dear", "big", "plain", "new1", "new2")}
    tier.put(k["cheap"], b"x" * 100, cost=10)  # score (0+1)*10/100 = 0.1
    tier.put(k["hot"], b"x" * 100, cost=10)  # read 9 times below: (9+1)*10/100 = 1.0
    tier.put(k["dear"], b"x" * 100, cost=300)  # 3.0
    tier.put(k["big"], b"x" * 400, cost=200)  # 0.5
    tier.put(k["plain"], b"x" * 200)  # no hint: cost = bytes -> 1.0, older than "hot"
    for _ in range(9):
        tier.get(k["hot"])
    # Each new 100-byte entry scores (0+1)*50/100 = 0.5 and needs 100 bytes freed.
    order = []
    for name in ("new1", "new2"):
        before = keys_of(tier)
        assert tier.put(k[name], b"n" * 100, cost=50)
        order.append(sorted(before - keys_of(tier)))
    # new1 evicts "cheap" (0.1). new2 ties "big" at 0.5 but "big" was used less recently.
    assert order == [[k["cheap"]], [k["big"]]]
    assert keys_of(tier) == {k["hot"], k["dear"], k["plain"], k["new1"], k["new2"]}


def test_cost_aware_ties_fall_back_to_lru() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=300&policy=cost")
    a, b, c, d = (make_key(x) for x in "abcd")
    for key in (a, b, c):
        tier.put(key, b"x" * 100)
    tier.get(a)
    tier.get(b)
    tier.get(c)  # all score 2.0; a was used longest ago
    tier.put(d, b"x" * 100, cost=1000)
    assert keys_of(tier) == {b, c, d}


def test_a_value_larger_than_the_budget_is_refused_and_nothing_is_evicted() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=300")
    tier.put(make_key(1), b"x" * 100)
    assert tier.put(make_key(2), b"x" * 301) is False
    assert keys_of(tier) == {make_key(1)}
    assert tier.stats().evictions == 0


def test_replacing_a_key_counts_its_old_size_once() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=300")
    tier.put(make_key(1), b"x" * 100)
    tier.put(make_key(2), b"x" * 100)
    assert tier.put(make_key(1), b"y" * 200)  # 300 in all: fits without evicting key 2
    assert keys_of(tier) == {make_key(1), make_key(2)}
    assert tier.stats().bytes_stored == 300


def test_a_tenant_within_its_fair_share_takes_room_only_from_tenants_over_theirs() -> None:
    """As the disk tier (issue 33): bob filled the tier; alice, within her share, is not locked out;
    bob is never pushed below his share; a tenant over its share evicts only its own entries."""
    tier = MemoryTier.from_url("memory://?max_bytes=400")
    for i in range(4):
        tier.put(make_key(i, "bob"), b"b" * 100)
    assert tier.put(make_key(0, "alice"), b"a" * 100)  # within her share (200): bob's oldest goes
    assert keys_of(tier, "bob") == {make_key(i, "bob") for i in (1, 2, 3)}
    assert tier.put(make_key(1, "alice"), b"a" * 100)  # up to her share: bob's next oldest
    assert keys_of(tier, "bob") == {make_key(2, "bob"), make_key(3, "bob")}
    assert tier.put(make_key(2, "alice"), b"a" * 100)  # over her share: her own oldest, never bob's
    assert keys_of(tier, "alice") == {make_key(1, "alice"), make_key(2, "alice")}
    assert keys_of(tier, "bob") == {make_key(2, "bob"), make_key(3, "bob")}
    # a value her own entries cannot make room for is refused, and nothing is evicted
    assert tier.put(make_key(3, "alice"), b"a" * 300) is False
    assert keys_of(tier, "alice") == {make_key(1, "alice"), make_key(2, "alice")}
    assert keys_of(tier, "bob") == {make_key(2, "bob"), make_key(3, "bob")}
    assert tier.put(make_key(4, "bob"), b"b" * 100)  # bob at his share: his own oldest goes
    assert keys_of(tier, "bob") == {make_key(3, "bob"), make_key(4, "bob")} and len(keys_of(tier, "alice")) == 2


def test_tenant_quota_leaves_room_for_other_tenants() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=400&tenant_max_bytes=200")
    for i in range(4):
        assert tier.put(make_key(i, "bob"), b"b" * 100)
    assert keys_of(tier, "bob") == {make_key(2, "bob"), make_key(3, "bob")}
    assert tier.put(make_key(0, "alice"), b"a" * 200)
    assert tier.put(make_key(1, "alice"), b"a" * 201) is False  # above her quota


def test_unknown_option_and_policy_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown option"):
        MemoryTier.from_url("memory://?max_byte=10")
    with pytest.raises(ValueError, match="eviction policy"):
        MemoryTier.from_url("memory://?policy=fifo")
    with pytest.raises(ValueError, match="does not take"):
        MemoryTier.from_url("memory://?ttl=5")


def test_concurrent_writers_and_readers_keep_the_budget() -> None:
    tier = MemoryTier.from_url("memory://?max_bytes=20000")
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(300):
                key = make_key(f"{worker}-{i % 50}")
                tier.put(key, bytes([worker]) * (100 + i % 7))
                value = tier.get(key)
                assert value is None or value == bytes([worker]) * len(value)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = tier.stats()
    assert stats.bytes_stored is not None and stats.bytes_stored <= 20000
    assert stats.bytes_stored == sum(len(tier.get(k) or b"") for k in tier.keys(tenant_namespace("default")))
