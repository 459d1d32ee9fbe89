"""TieredStore: read-down with promotion, write-through, invalidation, faults that never reach get."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ragkv.cache.config import TierConfig
from ragkv.cache.memory import MemoryTier
from ragkv.cache.registry import open_tier
from ragkv.cache.store import TieredStore, open_store
from ragkv.cache.store_config import StoreConfig
from ragkv.cache.tier import Tier
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import CLOSED_PORT_REDIS, BlockingTier, BrokenTier, make_key


@pytest.fixture
def stores() -> Iterator[Callable[..., TieredStore]]:
    opened: list[TieredStore] = []

    def make(tiers: list[str | Tier], **config: object) -> TieredStore:
        store = TieredStore([open_tier(t) if isinstance(t, str) else t for t in tiers], StoreConfig(**config))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_a_hit_below_is_promoted_into_the_tiers_above(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(["memory://", f"disk://{tmp_path / 'disk'}", f"file://{tmp_path / 'obj'}"])
    memory, disk, objects = store.tiers
    objects.put(make_key(1), b"from the bottom")
    assert store.get(make_key(1)) == b"from the bottom"
    assert memory.get(make_key(1)) == b"from the bottom"
    assert disk.get(make_key(1)) == b"from the bottom"
    assert [s.hits for s in store.stats().values()] == [1, 1, 1]  # promotion copies, tests read above


def test_promotion_can_be_turned_off(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(["memory://", f"disk://{tmp_path}"], promote=False)
    store.tiers[1].put(make_key(1), b"v")
    assert store.get(make_key(1)) == b"v"
    assert not store.tiers[0].contains(make_key(1))


def test_get_many_collects_across_tiers_in_order_and_promotes(
    stores: Callable[..., TieredStore], tmp_path: Path
) -> None:
    store = stores(["memory://", f"disk://{tmp_path}"])
    memory, disk = store.tiers
    memory.put(make_key(1), b"one")
    disk.put(make_key(2), b"two")
    disk.put(make_key(1), b"stale copy below")
    found = store.get_many([make_key(2), make_key(3), make_key(1)])
    assert found == {make_key(2): b"two", make_key(1): b"one"}
    assert list(found) == [make_key(2), make_key(1)]
    assert memory.get(make_key(2)) == b"two"
    assert disk.stats().hits == 1 and disk.stats().misses == 1  # key 1 was not asked of the disk


def test_put_writes_through_to_every_writable_tier(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(["memory://", f"disk://{tmp_path / 'd'}", f"file://{tmp_path / 'o'}?write=0"])
    assert store.put(make_key(1), b"v", cost=12)
    memory, disk, read_only = store.tiers
    assert memory.get(make_key(1)) == disk.get(make_key(1)) == b"v"
    assert read_only.get(make_key(1)) is None
    assert store.contains(make_key(1))


def test_tenants_never_read_list_push_out_or_lock_out_each_other(
    stores: Callable[..., TieredStore], tmp_path: Path
) -> None:
    store = stores(["memory://?max_bytes=300", f"disk://{tmp_path}?max_bytes=300"])
    disk = store.tiers[1]
    bob = [make_key(i, "bob") for i in range(3)]
    for key in bob:
        store.put(key, b"b" * 100)
    alice = make_key(0, "alice")
    # bob filled both tiers: alice, within her fair share (150 of 300), takes room from bob, over his
    assert store.put(alice, b"a" * 100) is True
    assert list(disk.keys(tenant_namespace("alice"))) == [alice]
    assert len(list(disk.keys(tenant_namespace("bob")))) == 2
    assert sorted(store.keys(tenant_namespace("bob"))) == sorted(bob[1:])  # the memory tier made room alike
    # bob, over his share, evicts only his own entries: alice is never pushed out
    assert store.put(make_key(3, "bob"), b"b" * 100) is True
    assert list(disk.keys(tenant_namespace("alice"))) == [alice]
    assert all(store.get(key) == b"b" * 100 for key in [*bob[2:], make_key(3, "bob")])
    assert store.get(bob[1]) is None  # his own oldest went, from both tiers
    # Reading bob's entries needs bob's keys: alice's keys name a different namespace.
    assert store.get(make_key(1, "alice")) is None and make_key(0, "alice") != make_key(0, "bob")


def test_invalidate_removes_a_corrupt_entry_from_every_tier(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(["memory://", f"disk://{tmp_path / 'd'}", f"file://{tmp_path / 'o'}"])
    store.put(make_key(1), b"truncated")
    assert store.invalidate(make_key(1))
    assert all(not tier.contains(make_key(1)) for tier in store.tiers)
    assert store.get(make_key(1)) is None
    assert not store.invalidate(make_key(1))


def test_invalidated_entries_of_a_read_only_tier_are_not_served_again(
    stores: Callable[..., TieredStore], tmp_path: Path
) -> None:
    shared = open_tier(f"file://{tmp_path}")
    shared.put(make_key(1), b"corrupt")
    shared.close()
    store = stores(["memory://", f"file://{tmp_path}?write=0"])
    assert store.get(make_key(1)) == b"corrupt"
    store.invalidate(make_key(1))
    assert store.get(make_key(1)) is None
    assert store.get_many([make_key(1)]) == {}
    assert not store.contains(make_key(1))
    store.put(make_key(1), b"recomputed")  # a fresh value in a writable tier is served again
    assert store.get(make_key(1)) == b"recomputed"


def test_a_down_redis_degrades_with_a_warning_and_a_counter(
    stores: Callable[..., TieredStore], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = stores(["memory://", CLOSED_PORT_REDIS, f"disk://{tmp_path}"])
    with caplog.at_level(logging.WARNING, logger="ragkv.cache.store"):
        assert store.put(make_key(1), b"v")  # memory and disk took it
        store.tiers[0].delete(make_key(1))
        assert store.get(make_key(1)) == b"v"  # redis failed, disk answered
        assert store.get(make_key(2)) is None
        assert store.get_many([make_key(1), make_key(3)]) == {make_key(1): b"v"}
    redis_stats = store.stats()["redis://127.0.0.1:1/0"]
    assert redis_stats.errors == 3  # then the circuit opened and redis was left alone
    assert "redis://127.0.0.1:1/0" in caplog.text and "skipping it" in caplog.text
    assert store.health() == {"memory://": "closed", "redis://127.0.0.1:1/0": "open", f"disk://{tmp_path}": "closed"}


def test_a_slow_tier_is_abandoned_after_its_timeout(
    stores: Callable[..., TieredStore], blocking_tier: BlockingTier, tmp_path: Path
) -> None:
    disk = open_tier(f"disk://{tmp_path}")
    disk.put(make_key(1), b"below the slow tier")
    store = stores(["memory://", blocking_tier, disk])
    # The blocking tier never answers on its own; get returns anyway, from the disk.
    assert store.get(make_key(1)) == b"below the slow tier"
    assert not blocking_tier.release.is_set()
    assert blocking_tier.stats().errors == 1
    assert store.put(make_key(2), b"v")  # put gives up on it too
    assert blocking_tier.stats().errors == 2


def test_the_breaker_stops_calling_a_failing_tier(stores: Callable[..., TieredStore]) -> None:
    broken = BrokenTier(TierConfig.from_url("memory://"))
    store = stores(["memory://", broken], breaker_failures=2, breaker_cooldown_s=3600)
    for i in range(5):
        assert store.get(make_key(i)) is None
    assert broken.calls == 2
    assert broken.stats().errors == 2


def test_the_breaker_probes_again_after_cooldown(stores: Callable[..., TieredStore]) -> None:
    broken = BrokenTier(TierConfig.from_url("memory://"))
    store = stores([broken, "memory://"], breaker_failures=1, breaker_cooldown_s=0)
    store.get(make_key(1))
    store.get(make_key(2))
    assert broken.calls == 2  # cooldown 0: every call is a probe


def test_bugs_in_a_tier_do_not_reach_the_query_path(
    stores: Callable[..., TieredStore], caplog: pytest.LogCaptureFixture
) -> None:
    buggy = BrokenTier(TierConfig.from_url("memory://"), error=RuntimeError)
    store = stores([buggy, "memory://"])
    assert store.put(make_key(1), b"v")  # the healthy tier stored it
    assert store.get(make_key(1)) == b"v"
    assert store.get_many([make_key(1)]) == {make_key(1): b"v"}
    assert buggy.stats().errors == 3
    assert "RuntimeError" in caplog.text


def test_put_reports_false_only_when_no_tier_stored(stores: Callable[..., TieredStore]) -> None:
    store = stores(["memory://?max_bytes=10", BrokenTier(TierConfig.from_url("memory://"))])
    assert store.put(make_key(1), b"small")
    assert store.put(make_key(2), b"far too large for ten bytes") is False


def test_bad_arguments_raise_instead_of_degrading(stores: Callable[..., TieredStore]) -> None:
    store = stores(["memory://"])
    with pytest.raises(ValueError, match="storage key"):
        store.get("not-a-key")
    with pytest.raises(TypeError, match="bytes"):
        store.put(make_key(1), "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cost"):
        store.put(make_key(1), b"v", cost=-1)


def test_open_store_parses_comma_separated_urls(tmp_path: Path) -> None:
    with open_store(f" memory://?max_bytes=1MiB , {tmp_path}/kv ,") as store:
        assert [type(t).__name__ for t in store.tiers] == ["MemoryTier", "DiskTier"]
        assert list(store.stats()) == ["memory://", f"disk://{tmp_path}/kv"]
    with pytest.raises(ValueError, match="no store URL"):
        open_store(" , ")
    with pytest.raises(ValueError, match="no storage tier for nope://"):
        open_store("memory://,nope://x")
    with pytest.raises(TypeError):
        TieredStore.from_urls("memory://")  # type: ignore[arg-type]


def test_stats_names_duplicate_tiers_apart() -> None:
    store = TieredStore([MemoryTier.from_url(), MemoryTier.from_url()])
    assert list(store.stats()) == ["memory://", "memory:// [1]"]
    store.close()


def test_usage_is_one_tenants_entries_and_bytes_per_tier(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    """`ragkv stats` shows the asking tenant's usage, not everyone's."""
    store = stores(["memory://", f"disk://{tmp_path / 'kv'}", f"file://{tmp_path / 'objects'}"])
    for i in range(3):
        store.put(make_key(i, "alice"), b"a" * 100)
    store.put(make_key(0, "bob"), b"b" * 40_000)  # a file on disk: counted all the same
    memory, disk, objects = (tier.name for tier in store.tiers)
    assert store.usage(tenant_namespace("alice")) == {memory: (3, 300), disk: (3, 300), objects: None}
    assert store.usage(tenant_namespace("bob")) == {memory: (1, 40_000), disk: (1, 40_000), objects: None}
    assert store.usage(tenant_namespace("carol"))[memory] == (0, 0)
    with pytest.raises(ValueError):
        store.usage("not a namespace")


def test_usage_of_a_failing_tier_is_unknown(stores: Callable[..., TieredStore]) -> None:
    store = stores([BrokenTier(TierConfig.from_url("memory://")), "memory://"])
    store.put(make_key(1), b"x" * 10)
    assert list(store.usage(tenant_namespace("default")).values()) == [None, (1, 10)]
