"""A put counts as stored only when a tier that outlives the process took it (issue 33, finding 1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ragkv.cache.store import open_store
from tests.cache.cache_testing import make_key


def test_a_value_only_the_memory_tier_took_is_not_stored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(f"memory://,disk://{tmp_path}?tenant_max_bytes=64") as store:
        with caplog.at_level(logging.WARNING):
            assert store.put(make_key(1), b"x" * 100) is False  # the disk refused it: over tenant_max_bytes
        assert store.get(make_key(1)) == b"x" * 100  # this process's memory tier still serves it
        assert store.contains(make_key(1)) and not store.persisted(make_key(1))
        disk = store.stats()[f"disk://{tmp_path}"]
        assert disk.refused == 1 and disk.bytes_in == 0
        assert "tenant_max_bytes=64" in caplog.text and "no lasting tier stored" in caplog.text
        assert store.put(make_key(2), b"small") is True and store.persisted(make_key(2))


def test_a_store_of_in_process_tiers_only_counts_them() -> None:
    with open_store("memory://,memory://?max_bytes=8") as store:
        assert store.put(make_key(1), b"x" * 100) is True  # the first memory tier took it: all there is
        assert store.persisted(make_key(1))


def test_a_read_only_lasting_tier_leaves_the_memory_tier_to_count(tmp_path: Path) -> None:
    with open_store(f"memory://,disk://{tmp_path}?write=0") as store:
        assert store.put(make_key(1), b"v") is True  # no lasting tier can take anything: memory counts
