"""The Tier contract, run against every tier kind (Redis ones need a server: marker ``redis``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ragkv.cache.tier import Tier
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import TIER_KINDS, make_key

pytestmark = pytest.mark.parametrize("kind", TIER_KINDS)


@pytest.fixture
def tier(kind: str, tier_url: Callable[..., str], open_tiers: Callable[[str], Tier]) -> Tier:
    return open_tiers(tier_url(kind))


def test_round_trip(tier: Tier) -> None:
    value = bytes(range(256)) * 1000  # big enough to go to a file on disk tiers
    assert tier.put(make_key(1), value)
    assert tier.put(make_key(2), b"")
    assert tier.get(make_key(1)) == value
    assert tier.get(make_key(2)) == b""
    assert tier.get(make_key(3)) is None


def test_overwrite_replaces(tier: Tier) -> None:
    tier.put(make_key(1), b"old")
    tier.put(make_key(1), b"new value")
    assert tier.get(make_key(1)) == b"new value"


def test_get_many_keeps_order_and_skips_missing(tier: Tier) -> None:
    for i in range(5):
        tier.put(make_key(i), f"value {i}".encode())
    wanted = [make_key(4), make_key(99), make_key(0), make_key(2)]
    found = tier.get_many(wanted)
    assert list(found) == [make_key(4), make_key(0), make_key(2)]
    assert found[make_key(0)] == b"value 0"
    assert tier.get_many([]) == {}


def test_delete_and_contains(tier: Tier) -> None:
    tier.put(make_key(1), b"x")
    assert tier.contains(make_key(1))
    assert tier.delete(make_key(1))
    assert not tier.contains(make_key(1))
    assert not tier.delete(make_key(1))
    assert tier.get(make_key(1)) is None


def test_keys_lists_one_namespace_only(tier: Tier) -> None:
    mine = sorted(make_key(i, "alice") for i in range(3))
    for key in mine:
        tier.put(key, b"a")
    tier.put(make_key(0, "bob"), b"b")
    assert sorted(tier.keys(tenant_namespace("alice"))) == mine
    assert list(tier.keys(tenant_namespace("bob"))) == [make_key(0, "bob")]
    assert list(tier.keys(tenant_namespace("carol"))) == []


@pytest.mark.parametrize(
    "bad",
    [
        "../etc/passwd",
        "0123456789abcdef/" + "A" * 64,  # uppercase
        "0123456789abcdef/" + "a" * 63,
        "0123456789abcdef/*",
        "0123456789abcdef/" + "a" * 64 + "/x",
        "0123456789abcde/" + "a" * 65,  # shifted separator
        "",
    ],
)
def test_malformed_keys_are_refused(tier: Tier, bad: str) -> None:
    for call in (tier.get, tier.contains, tier.delete):
        with pytest.raises(ValueError, match="storage key"):
            call(bad)
    with pytest.raises(ValueError):
        tier.put(bad, b"x")
    with pytest.raises(ValueError):
        tier.get_many([make_key(1), bad])


def test_namespace_must_be_a_namespace(tier: Tier) -> None:
    with pytest.raises(ValueError, match="tenant_namespace"):
        tier.keys("*")


def test_values_must_be_bytes(tier: Tier) -> None:
    with pytest.raises(TypeError, match="bytes"):
        tier.put(make_key(1), "text")  # type: ignore[arg-type]
    assert tier.put(make_key(1), bytearray(b"ok"))
    assert tier.get(make_key(1)) == b"ok"


def test_stats_count_lookups_and_bytes(tier: Tier) -> None:
    tier.put(make_key(1), b"12345")
    tier.get(make_key(1))
    tier.get(make_key(2))
    tier.get_many([make_key(1), make_key(3)])
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_in, stats.bytes_out, stats.errors) == (2, 2, 5, 10, 0)
    assert stats.hit_rate == 0.5
    if stats.entries is not None:
        assert (stats.entries, stats.bytes_stored) == (1, 5)


def test_read_only_tier_refuses_writes(
    kind: str, tier_url: Callable[..., str], open_tiers: Callable[[str], Tier]
) -> None:
    writer = open_tiers(tier_url(kind))
    writer.put(make_key(1), b"shared")
    reader = open_tiers(tier_url(kind, "write=0"))
    assert not reader.writable
    # Memory tiers are process-local: a second one is a different, empty store.
    assert reader.get(make_key(1)) == (None if kind == "memory" else b"shared")
    assert reader.put(make_key(2), b"x") is False
    assert reader.delete(make_key(1)) is False
    assert writer.get(make_key(2)) is None and writer.get(make_key(1)) == b"shared"
