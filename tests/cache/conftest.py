"""Fixtures for ragkv.cache tests: server URLs (skip locally, fail under CI), tiers, fault tiers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ragkv.cache.config import TierConfig
from ragkv.cache.registry import open_tier
from ragkv.cache.tier import Tier
from tests.cache.cache_testing import POSTGRES_URL, REDIS_URL, BlockingTier, server_unreachable


@pytest.fixture(scope="session")
def redis_server() -> str:
    """RAGKV_TEST_REDIS_URL, checked to answer PING."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
        client.ping()
        client.close()
    except redis.RedisError as e:
        server_unreachable(f"Redis at {REDIS_URL}", e)
    return REDIS_URL


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A Redis tier URL with a key prefix of its own; its keys are deleted afterwards."""
    import redis

    prefix = f"ragkv-test-{uuid.uuid4().hex[:12]}:"
    yield f"{redis_server}?prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    for name in client.scan_iter(match=f"{prefix}*"):
        client.delete(name)
    client.close()


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """RAGKV_TEST_POSTGRES_URL, checked to accept a connection."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import SQLAlchemyError

    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as e:
        server_unreachable(f"PostgreSQL at {POSTGRES_URL}", e)
    finally:
        engine.dispose()
    return POSTGRES_URL


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """The test database, emptied of ragkv's tables before and after the test."""
    from sqlalchemy import create_engine

    from ragkv.cache.catalog_schema import metadata

    def drop() -> None:
        engine = create_engine(postgres_server)
        metadata.drop_all(engine)
        engine.dispose()

    drop()
    yield postgres_server
    drop()


@pytest.fixture
def tier_url(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str, str], str]:
    """``tier_url(kind, query)``: a URL for a fresh tier of ``kind``."""

    def build(kind: str, query: str = "") -> str:
        urls = {
            "memory": lambda: "memory://",
            "disk": lambda: f"disk://{tmp_path / 'disk'}",
            "file": lambda: f"file://{tmp_path / 'objects'}",
            "redis": lambda: request.getfixturevalue("redis_url"),
        }
        url = urls[kind]()
        return f"{url}{'&' if '?' in url else '?'}{query}" if query else url

    return build


@pytest.fixture
def open_tiers() -> Iterator[Callable[[str], Tier]]:
    """``open(url)``: open a tier that is closed after the test."""
    opened: list[Tier] = []

    def _open(url: str) -> Tier:
        tier = open_tier(url)
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        tier.close()


@pytest.fixture
def blocking_tier() -> Iterator[BlockingTier]:
    tier = BlockingTier(TierConfig.from_url("memory://?timeout=0.2"))
    yield tier
    tier.release.set()
    tier.close()
