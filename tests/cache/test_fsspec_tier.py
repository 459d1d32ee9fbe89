"""FsspecTier on file://: layout, atomic writes (a writer killed before its rename), no partial reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from ragkv.cache.fsspec_tier import FsspecTier
from ragkv.cache.registry import open_tier
from ragkv.types import tenant_namespace
from tests.cache.cache_testing import make_key


def objects(path: Path, query: str = "") -> FsspecTier:
    tier = open_tier(f"file://{path}{'?' + query if query else ''}")
    assert isinstance(tier, FsspecTier)
    return tier


def test_layout_is_namespace_then_digest(tmp_path: Path) -> None:
    tier = objects(tmp_path)
    key = make_key(1)
    tier.put(key, b"v")
    namespace, digest = key.split("/")
    assert (tmp_path / namespace / digest[:2] / digest).read_bytes() == b"v"
    assert not list(tmp_path.rglob(".tmp-*"))  # the temporary was renamed away


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys
    from ragkv.cache.fsspec_tier import FsspecTier
    from ragkv.cache.registry import open_tier

    def die_before_rename(self, temp, path):
        os._exit(9)  # the process is killed between writing the temporary and renaming it

    FsspecTier.commit = die_before_rename
    tier = open_tier(sys.argv[1])
    tier.put(sys.argv[2], b"x" * 1_000_000)
    """
)


def test_a_writer_killed_before_rename_leaves_nothing_visible(tmp_path: Path) -> None:
    key = make_key("killed")
    url = f"file://{tmp_path}"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, url, key], capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr.decode()
    temps = list(tmp_path.rglob(".tmp-*"))
    assert len(temps) == 1 and temps[0].stat().st_size == 1_000_000  # the bytes were written...
    tier = objects(tmp_path)
    assert tier.get(key) is None  # ...but no reader can see them
    assert not tier.contains(key)
    assert list(tier.keys(tenant_namespace("default"))) == []
    assert tier.get_many([key]) == {}


def test_a_failed_rename_removes_its_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = objects(tmp_path)

    def broken_commit(self: FsspecTier, temp: str, path: str) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(FsspecTier, "commit", broken_commit)
    with pytest.raises(Exception, match="rename failed"):
        tier.put(make_key(1), b"v")
    assert tier.stats().errors == 1
    assert not list(tmp_path.rglob(".tmp-*"))
    assert tier.get(make_key(1)) is None


def test_readers_see_the_old_or_the_new_value_never_a_mix(tmp_path: Path) -> None:
    tier = objects(tmp_path)
    key = make_key(1)
    values = [bytes([i]) * 2_000_000 for i in range(1, 6)]
    tier.put(key, values[0])
    seen: list[bytes | None] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(tier.get(key))

    reader = threading.Thread(target=read)
    reader.start()
    for value in values[1:] * 3:
        tier.put(key, value)
    stop.set()
    reader.join()
    assert seen and all(v in values for v in seen)


def test_storage_options_come_from_the_query(tmp_path: Path) -> None:
    tier = objects(tmp_path, "auto_mkdir=true&write=1")
    assert tier._fs.auto_mkdir is True
    tier.put(make_key(1), b"v")
    assert tier.get(make_key(1)) == b"v"


def test_a_missing_backend_package_says_what_to_install() -> None:
    with pytest.raises(ImportError, match="fsspec backend"):
        open_tier("dropbox://folder/kv")
