"""DiskTier: exact eviction on disk, tenants, a full disk, no pickles, sharing between processes."""

from __future__ import annotations

import errno
import io
import logging
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import diskcache
import pytest

from ragkv.cache import bytes_disk
from ragkv.cache.disk import DiskTier
from ragkv.cache.registry import open_tier
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import make_key


def disk(path: Path, query: str = "") -> DiskTier:
    tier = open_tier(f"disk://{path}{'?' + query if query else ''}")
    assert isinstance(tier, DiskTier)
    return tier


def keys_of(tier: DiskTier, tenant: str = "default") -> set[str]:
    return set(tier.keys(tenant_namespace(tenant)))


def test_plain_path_opens_a_disk_tier(tmp_path: Path) -> None:
    tier = open_tier(str(tmp_path / "kv"))
    assert isinstance(tier, DiskTier)
    assert tier.directory == str(tmp_path / "kv")
    tier.close()


def test_lru_eviction_order_on_disk(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=400")
    a, b, c, d, e, f = (make_key(x) for x in "abcdef")
    for key in (a, b, c, d):
        assert tier.put(key, b"x" * 100)
    tier.get(a)
    evicted = []
    for key in (e, f):
        before = keys_of(tier)
        assert tier.put(key, b"y" * 100)
        evicted += sorted(before - keys_of(tier))
    assert evicted == [b, c]
    assert keys_of(tier) == {d, a, e, f}
    assert (tier.stats().evictions, tier.stats().bytes_stored) == (2, 400)
    tier.close()


def test_cost_aware_eviction_order_on_disk(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=900&policy=cost")
    k = {name: make_key(name) for name in ("cheap", "hot", "dear", "big", "plain", "new1", "new2")}
    tier.put(k["cheap"], b"x" * 100, cost=10)  # (0+1)*10/100 = 0.1
    tier.put(k["hot"], b"x" * 100, cost=10)  # (9+1)*10/100 = 1.0 after 9 reads
    tier.put(k["dear"], b"x" * 100, cost=300)  # 3.0
    tier.put(k["big"], b"x" * 400, cost=200)  # 0.5
    tier.put(k["plain"], b"x" * 200)  # cost = bytes -> 1.0
    for _ in range(9):
        tier.get(k["hot"])
    order = []
    for name in ("new1", "new2"):
        before = keys_of(tier)
        assert tier.put(k[name], b"n" * 100, cost=50)  # 0.5
        order.append(sorted(before - keys_of(tier)))
    assert order == [[k["cheap"]], [k["big"]]]
    tier.close()


def test_large_values_go_to_files_and_count_in_the_budget(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=200000")
    tier.put(make_key(1), b"f" * 100_000)  # over diskcache's 32 KiB inline limit: a file
    tier.put(make_key(2), b"s" * 1000)  # inline in SQLite
    assert tier.stats().bytes_stored == 101_000
    assert tier.put(make_key(3), b"g" * 100_000)  # evicts key 1 (least recent)
    assert keys_of(tier) == {make_key(2), make_key(3)}
    assert len(list((tmp_path).rglob("*.val"))) == 1  # key 1's file is gone
    tier.close()


def test_oversize_value_is_refused(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=1000")
    tier.put(make_key(1), b"x" * 500)
    assert tier.put(make_key(2), b"x" * 1001) is False
    assert keys_of(tier) == {make_key(1)}
    tier.close()


def test_tenants_do_not_evict_each_other_on_disk(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=300")
    tier.put(make_key(0, "bob"), b"b" * 100)
    tier.put(make_key(1, "bob"), b"b" * 100)
    tier.put(make_key(0, "alice"), b"a" * 100)
    assert tier.put(make_key(1, "alice"), b"a" * 100)  # evicts alice's own entry
    assert tier.put(make_key(2, "alice"), b"a" * 200) is False  # would need bob's
    assert keys_of(tier, "bob") == {make_key(0, "bob"), make_key(1, "bob")}
    assert keys_of(tier, "alice") == {make_key(1, "alice")}
    tier.close()


class _FullDiskFile(io.BufferedWriter):
    """Writes half of what it is given, then fails like a full disk."""

    def write(self, data: Any) -> int:
        super().write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_refuses_the_write_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = disk(tmp_path)
    tier.put(make_key(1), b"o" * 50_000)
    files_before = sorted(tmp_path.rglob("*.val"))

    def full_open(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return _FullDiskFile(io.FileIO(path, mode))

    monkeypatch.setattr(bytes_disk, "open", full_open, raising=False)
    assert tier.put(make_key(2), b"n" * 50_000) is False
    assert tier.put(make_key(1), b"r" * 50_000) is False  # a replacement fails too...
    monkeypatch.undo()
    assert tier.get(make_key(1)) == b"o" * 50_000  # ...and the old value is intact
    assert tier.get(make_key(2)) is None
    assert sorted(tmp_path.rglob("*.val")) == files_before
    assert tier.stats().errors == 2
    assert "is full" in caplog.text
    tier.close()


class _Payload:
    """If this were ever unpickled it would leave a mark."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.marker).touch, ())


def test_pickled_values_written_by_others_are_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    foreign = diskcache.Cache(str(tmp_path / "kv"))
    foreign.set(make_key(1), _Payload(str(marker)))
    foreign.set(make_key(2), b"fine")
    foreign.close()
    tier = disk(tmp_path / "kv")
    assert tier.get(make_key(1)) is None
    assert tier.get_many([make_key(1), make_key(2)]) == {make_key(2): b"fine"}
    assert not marker.exists()
    assert tier.stats().errors == 2
    tier.close()


def test_non_bytes_never_reach_diskcache(tmp_path: Path) -> None:
    disk_ = bytes_disk.BytesDisk(str(tmp_path))
    with pytest.raises(TypeError):
        disk_.store({"a": 1}, read=False)
    with pytest.raises(TypeError):
        disk_.put(("tuple", "key"))


def test_entries_survive_reopen(tmp_path: Path) -> None:
    tier = disk(tmp_path, "max_bytes=10000")
    tier.put(make_key(1), b"persisted")
    tier.close()
    again = disk(tmp_path, "max_bytes=10000")
    assert again.get(make_key(1)) == b"persisted"
    assert again.stats().entries == 1
    again.close()


def test_ttl_expires_entries(tmp_path: Path) -> None:
    tier = disk(tmp_path, "ttl=0.05")
    tier.put(make_key(1), b"soon gone")
    time.sleep(0.1)
    assert tier.get(make_key(1)) is None
    assert list(tier.keys(tenant_namespace("default"))) == []
    tier.close()


WRITER = textwrap.dedent(
    """
    import sys
    from ragkv.cache.registry import open_tier
    from ragkv.digests import sha256_hex
    from ragkv.types import tenant_namespace
    tier = open_tier(sys.argv[1])
    worker = sys.argv[2]
    ns = tenant_namespace("default")
    for i in range(60):
        key = f"{ns}/{sha256_hex(f'{worker}-{i}'.encode())}"
        assert tier.put(key, worker.encode() * 1000)
        value = tier.get(key)
        assert value is None or value == worker.encode() * 1000
    tier.close()
    """
)


def test_two_processes_share_a_directory_within_budget(tmp_path: Path) -> None:
    url = f"disk://{tmp_path}?max_bytes=20000"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, url, worker], stderr=subprocess.PIPE) for worker in ("a", "b")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    tier = disk(tmp_path, "max_bytes=20000")
    stats = tier.stats()
    assert stats.bytes_stored is not None and 0 < stats.bytes_stored <= 20000
    for key in tier.keys(tenant_namespace("default")):
        value = tier.get(key)
        assert value is not None and value in (b"a" * 1000, b"b" * 1000)
    tier.close()


def _point_row_at(tier: DiskTier, key: str, filename: str) -> None:
    """Tamper with the tier's index as an attacker with write access to cache.db would."""
    conn = sqlite3.connect(Path(tier.directory) / "cache.db")
    conn.execute("UPDATE Cache SET filename = ? WHERE key = ?", (filename, key))
    conn.commit()
    conn.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not the tier's to delete")
    return secret


@pytest.mark.parametrize("spelling", ["absolute", "traversal", "symlink"])
def test_a_row_pointing_outside_the_tier_is_never_read_or_deleted(
    tmp_path: Path, outside: Path, spelling: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = disk(tmp_path / "kv")
    keys = [make_key(i) for i in range(4)]
    for key in keys:
        assert tier.put(key, b"v" * 40_000)  # over the inline limit: each value is a file
    if spelling == "symlink":
        (tmp_path / "kv" / "link.val").symlink_to(outside)
    filename = {
        "absolute": str(outside),
        "traversal": f"../elsewhere/{outside.name}",
        "symlink": "link.val",
    }[spelling]
    for key in keys:
        _point_row_at(tier, key, filename)
    with caplog.at_level(logging.WARNING, logger="ragkv.cache"):
        assert tier.get(keys[0]) is None  # not opened: the secret is not served as a cache entry
        assert keys[0] not in keys_of(tier)  # the corrupt row is dropped
        assert tier.delete(keys[1])  # invalidate: the row goes, the file it names stays
        assert tier.put(keys[2], b"new" * 20_000)  # an overwrite removes the old value's file
    assert outside.read_text() == "not the tier's to delete"
    assert "outside" in caplog.text
    assert tier.get(keys[2]) == b"new" * 20_000
    assert keys_of(tier) == {keys[2], keys[3]}
    tier.close()


def test_eviction_never_deletes_outside_the_tier(tmp_path: Path, outside: Path) -> None:
    tier = disk(tmp_path / "kv", "max_bytes=100000")
    old = make_key("old")
    assert tier.put(old, b"o" * 40_000)
    _point_row_at(tier, old, str(outside))
    assert tier.put(make_key("a"), b"a" * 40_000)
    assert tier.put(make_key("b"), b"b" * 40_000)  # evicts the tampered entry
    assert old not in keys_of(tier)
    assert outside.exists()
    tier.close()


def test_removing_a_value_file_never_removes_the_tier_directory(tmp_path: Path) -> None:
    disk_ = bytes_disk.BytesDisk(str(tmp_path / "kv"))
    filename, full_path = disk_.filename()
    disk_.write_file(full_path, b"x")
    disk_.remove(filename)
    assert not Path(full_path).exists() and not Path(full_path).parent.exists()
    assert (tmp_path / "kv").is_dir()


def test_invalidating_a_tampered_entry_keeps_the_file_it_names(tmp_path: Path, outside: Path) -> None:
    tier = disk(tmp_path / "kv")
    key = make_key(1)
    assert tier.put(key, b"v" * 40_000)
    _point_row_at(tier, key, f"../elsewhere/{outside.name}")
    assert tier.delete(key)
    assert outside.exists() and key not in keys_of(tier)
    tier.close()


def test_a_tenant_within_its_fair_share_is_never_locked_out(tmp_path: Path) -> None:
    """Tenant A filled a shared 1 MiB disk tier (no per-tenant limit); B's small write still fits, by
    evicting A's least recent entries, never below A's share (issue 33, finding 6)."""
    tier = disk(tmp_path, "max_bytes=1MiB")
    for i in range(24):  # 1.5 MiB of A's: the tier keeps the last 1 MiB
        assert tier.put(make_key(i, "a"), b"a" * 65536)
    assert len(keys_of(tier, "a")) == 16
    assert tier.put(make_key(0, "b"), b"b" * 65536)
    assert keys_of(tier, "b") == {make_key(0, "b")} and make_key(8, "a") not in keys_of(tier, "a")
    for i in range(1, 8):  # B grows to its share (half): A's oldest go
        assert tier.put(make_key(i, "b"), b"b" * 65536)
    assert len(keys_of(tier, "a")) == 8 and len(keys_of(tier, "b")) == 8
    assert tier.put(make_key(8, "b"), b"b" * 65536)  # B over its share: its own oldest goes, not A's
    assert len(keys_of(tier, "a")) == 8 and make_key(0, "b") not in keys_of(tier, "b")
    tier.close()


def _scanned_usage(cache: Any, namespace: str | None) -> tuple[int, int]:
    """The obvious slow path: sum the Cache table (what the tier did per write before)."""
    query, args = "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM Cache", ()
    if namespace is not None:
        query, args = f"{query} WHERE key >= ? AND key < ?", (f"{namespace}/", f"{namespace}0")
    ((count, nbytes),) = cache._sql(query, args).fetchall()
    return int(count), int(nbytes)


def test_the_kept_usage_equals_a_scan_through_writes_overwrites_evictions_and_deletes(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    tier = disk(tmp_path / "kv", "max_bytes=6000&tenant_max_bytes=4000")
    tenants = ("alice", "bob", "carol")
    for step in range(300):
        tenant, n = rng.choice(tenants), rng.randrange(12)
        key = make_key(n, tenant)
        if rng.random() < 0.2:
            tier.delete(key)
        else:  # small values in the database, large ones in files; overwrites change the size
            tier.put(key, bytes(rng.randrange(256) for _ in range(rng.choice((10, 300, 900)))))
        if step % 50 == 49:
            tier.close()  # the kept counts outlive the process's connection
            tier = disk(tmp_path / "kv", "max_bytes=6000&tenant_max_bytes=4000")
        cache = tier._cache
        for namespace in (None, *(tenant_namespace(t) for t in tenants)):
            assert cache.usage(namespace) == _scanned_usage(cache, namespace), (step, namespace)
    tier.close()


def test_a_tier_written_before_the_kept_usage_existed_counts_its_rows(tmp_path: Path) -> None:
    tier = disk(tmp_path / "kv")
    for n in range(5):
        tier.put(make_key(n, "bob"), b"x" * (100 + n))
    cache = tier._cache
    cache._sql("DROP TABLE RagkvUsage")  # as a directory an older ragkv wrote
    for name in ("insert", "update", "delete"):
        cache._sql(f"DROP TRIGGER RagkvUsage_{name}")
    tier.close()
    tier = disk(tmp_path / "kv")
    assert tier._cache.usage(tenant_namespace("bob")) == (5, 510) == tier._cache.usage()
    tier.close()
