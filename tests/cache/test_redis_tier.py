"""RedisTier: TTL, pipelined get_many, ACL users from the URL, a server that is down."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from ragkv.cache.redis_tier import RedisTier
from ragkv.cache.registry import open_tier
from ragkv.errors import StoreUnavailableError
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import CLOSED_PORT_REDIS, make_key


def open_redis(url: str) -> RedisTier:
    tier = open_tier(url)
    assert isinstance(tier, RedisTier)
    return tier


@pytest.mark.redis
def test_ttl_is_set_on_every_put(redis_url: str) -> None:
    tier = open_redis(f"{redis_url}&ttl=30")
    tier.put(make_key(1), b"v")
    client = redis.Redis.from_url(redis_url.split("?")[0])
    prefix = redis_url.split("prefix=")[1]
    assert 0 < client.pttl(f"{prefix}{make_key(1)}") <= 30_000
    client.close()
    tier.close()


@pytest.mark.redis
def test_get_many_spans_several_mget_batches(redis_url: str) -> None:
    tier = open_redis(redis_url)
    keys = [make_key(i) for i in range(RedisTier.mget_batch * 2 + 5)]
    for i, key in enumerate(keys[::2]):
        tier.put(key, f"{i}".encode())
    stored = set(keys[::2])
    found = tier.get_many(reversed(keys))
    assert list(found) == [k for k in reversed(keys) if k in stored]
    tier.close()


@pytest.mark.redis
def test_keys_with_a_glob_in_the_prefix_match_literally(redis_server: str) -> None:
    glob_tier = open_redis(f"{redis_server}?prefix=t{uuid.uuid4().hex[:6]}*:")
    other = open_redis(f"{redis_server}?prefix=t{uuid.uuid4().hex[:6]}x:")
    glob_tier.put(make_key(1), b"a")
    other.put(make_key(2), b"b")
    assert list(glob_tier.keys(tenant_namespace("default"))) == [make_key(1)]
    for tier in (glob_tier, other):
        for key in list(tier.keys(tenant_namespace("default"))):
            tier.delete(key)
        tier.close()


@pytest.fixture
def acl_user(redis_server: str) -> Iterator[tuple[str, str]]:
    admin = redis.Redis.from_url(redis_server)
    user, password = f"ragkv-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["ragkvacl:*"], commands=["+@all"])
    yield user, password
    for name in admin.scan_iter(match="ragkvacl:*"):
        admin.delete(name)
    admin.acl_deluser(user)
    admin.close()


@pytest.mark.redis
def test_acl_user_and_password_come_from_the_url(redis_server: str, acl_user: tuple[str, str]) -> None:
    user, password = acl_user
    host = redis_server.split("://", 1)[1]
    tier = open_redis(f"redis://{user}:{password}@{host}?prefix=ragkvacl:")
    assert tier.put(make_key(1), b"secret") and tier.get(make_key(1)) == b"secret"
    assert "***" in tier.name and password not in tier.name
    tier.close()
    wrong = open_redis(f"redis://{user}:wrong@{host}?prefix=ragkvacl:")
    with pytest.raises(StoreUnavailableError):
        wrong.get(make_key(1))
    wrong.close()


def test_a_down_server_raises_store_unavailable_and_counts_it() -> None:
    tier = open_redis(CLOSED_PORT_REDIS)
    with pytest.raises(StoreUnavailableError) as info:
        tier.get(make_key(1))
    assert isinstance(info.value.__cause__, redis.RedisError)
    with pytest.raises(StoreUnavailableError):
        tier.put(make_key(1), b"v")
    assert tier.stats().errors == 2
    tier.close()


def test_options_redis_does_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="does not take"):
        open_tier("redis://127.0.0.1:6379/0?max_bytes=1GiB")
    with pytest.raises(ValueError, match="bad Redis URL"):
        open_tier("redis://127.0.0.1:6379/0?no_such_redis_option=1")
