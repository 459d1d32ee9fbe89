"""Helpers for ragkv.cache tests: keys, server URLs and fault-injecting tiers.

Test files import these by name (``tests.cache.cache_testing``); conftest.py holds the fixtures.
The catalog's writer subprocesses import ``document`` from here too.
"""

from __future__ import annotations

import os
import threading
from typing import ClassVar

import pytest

from ragkv.cache.config import TierConfig
from ragkv.cache.document_record import DocumentRecord
from ragkv.cache.memory import MemoryTier
from ragkv.digests import sha256_hex
from ragkv.errors import StoreUnavailableError
from ragkv.types import Chunk, tenant_namespace

REDIS_URL = os.environ.get("RAGKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("RAGKV_TEST_POSTGRES_URL", "postgresql+psycopg://ragkv:ragkv@127.0.0.1:5432/ragkv_test")
CLOSED_PORT_REDIS = "redis://127.0.0.1:1/0?timeout=0.5"  # nothing listens on port 1


def make_key(i: int | str, tenant: str = "default") -> str:
    """A valid storage key: ``<tenant namespace>/<sha256 of i>``."""
    return f"{tenant_namespace(tenant)}/{sha256_hex(str(i).encode())}"


def document(source: str, n: int, tenant: str = "default", version: str = "v1") -> tuple[DocumentRecord, list[Chunk]]:
    doc_id = sha256_hex(f"{tenant}:{source}:{version}".encode())
    doc = DocumentRecord(doc_id, tenant, source, sha256_hex(version.encode()), f"Title of {source}", n)
    chunks = [
        Chunk(
            chunk_id=sha256_hex(f"{doc_id}:{i}".encode()),
            doc_id=doc_id,
            ordinal=i,
            text=f"chunk {i} of {source} ({version}) ünïcode",
            token_ids=tuple(range(i, i + 5)) + (2**32 - 1,),
            source=source,
        )
        for i in range(n)
    ]
    return doc, chunks


def server_unreachable(what: str, why: object) -> None:
    """Skip locally; under CI a missing server is a failure, so CI cannot skip silently."""
    message = f"{what} is unreachable ({why}); start it with .ci/services.sh"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set, so this is an error: {message}")
    pytest.skip(message)


TIER_KINDS = ["memory", "disk", "file", pytest.param("redis", marks=pytest.mark.redis)]


class BlockingTier(MemoryTier):
    """A fault injector: a memory tier whose calls hang until released (a stuck mount or socket)."""

    in_process: ClassVar[bool] = False  # so TieredStore bounds it with its timeout

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self.release = threading.Event()
        self.calls = 0

    def _get(self, key: str) -> bytes | None:
        self.calls += 1
        self.release.wait()
        return super()._get(key)

    def _put(self, key: str, value: bytes, cost: float | None) -> bool:
        self.calls += 1
        self.release.wait()
        return super()._put(key, value, cost)


class BrokenTier(MemoryTier):
    """A fault injector: every call fails, the way a down backend does (or with a bug)."""

    in_process: ClassVar[bool] = True

    def __init__(self, config: TierConfig, error: type[Exception] = StoreUnavailableError) -> None:
        super().__init__(config)
        self.error = error
        self.calls = 0

    def _fail(self) -> None:
        self.calls += 1
        raise self.error("injected failure")

    def _get(self, key: str) -> bytes | None:
        self._fail()
        return None

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        self._fail()
        return {}

    def _put(self, key: str, value: bytes, cost: float | None) -> bool:
        self._fail()
        return False

    def _delete(self, key: str) -> bool:
        self._fail()
        return False

    def _namespace_usage(self, namespace: str) -> tuple[int, int] | None:
        self._fail()
        return None
