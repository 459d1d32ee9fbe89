"""The tier registry: schemes, fsspec pass-through, custom tiers, options a tier does not take."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ragkv.cache import registry
from ragkv.cache.disk import DiskTier
from ragkv.cache.fsspec_tier import FsspecTier
from ragkv.cache.memory import MemoryTier
from ragkv.cache.redis_tier import RedisTier
from ragkv.cache.registry import open_tier, register_tier, tier_class
from tests.cache.cache_testing import make_key


@pytest.mark.parametrize(
    ("scheme", "cls"),
    [
        ("memory", MemoryTier),
        ("disk", DiskTier),
        ("redis", RedisTier),
        ("rediss", RedisTier),
        ("file", FsspecTier),
        ("s3", FsspecTier),
        ("gs", FsspecTier),
    ],
)
def test_schemes_map_to_tiers(scheme: str, cls: type) -> None:
    assert tier_class(scheme) is cls


def test_unknown_schemes_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"no storage tier for nosuch://.*memory"):
        tier_class("nosuch")


class EchoTier(MemoryTier):
    """A custom tier, registered by a plugin."""


@pytest.fixture
def echo_scheme() -> Iterator[str]:
    register_tier("echo", EchoTier)
    yield "echo"
    registry._TIERS.pop("echo")


def test_custom_tiers_register_by_scheme(echo_scheme: str) -> None:
    tier = open_tier(f"{echo_scheme}://?max_bytes=100")
    assert isinstance(tier, EchoTier)
    assert tier.put(make_key(1), b"v") and tier.get(make_key(1)) == b"v"


def test_register_rejects_bad_schemes() -> None:
    with pytest.raises(ValueError, match="lowercase"):
        register_tier("Echo", EchoTier)


@pytest.mark.parametrize(
    "url",
    ["memory://?ttl=3", "file:///tmp/x?max_bytes=1GiB", "redis://h/0?policy=cost", "memory://?bogus=1"],
)
def test_tiers_refuse_options_they_do_not_take(url: str) -> None:
    with pytest.raises(ValueError, match="option"):
        open_tier(url)
