"""``BytesDisk``: a diskcache serialization strategy that stores bytes and nothing else.

diskcache's default ``Disk`` pickles any value that is not str/bytes/int/float and unpickles
whatever it finds. Stored KV must never be pickled (unpickling runs code), so this strategy
stores only ``bytes`` values under ``str`` keys and refuses to decode anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from typing import Any

from diskcache import Disk
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

__all__ = ["BytesDisk", "path_inside"]

logger = logging.getLogger(__name__)


def path_inside(directory: str, filename: str) -> str | None:
    """The real path of ``directory/filename`` if it lies strictly inside ``directory``, else None.

    Symlinks are resolved first, so a link that points out of the directory is outside too.

    >>> path_inside("/kv", "ab/cd/x.val"), path_inside("/kv", "../etc/passwd"), path_inside("/kv", "/etc/passwd")
    ('/kv/ab/cd/x.val', None, None)
    """
    root = os.path.realpath(directory)
    full_path = os.path.realpath(os.path.join(root, filename))
    if full_path == root or os.path.commonpath([root, full_path]) != root:
        return None
    return full_path


class BytesDisk(Disk):  # type: ignore[misc]  # diskcache ships no type hints
    """Keys are str, values are bytes: small ones inline in SQLite, large ones in files.

    Differences from ``diskcache.Disk``:

    * any other key or value type raises ``TypeError`` (instead of being pickled), and rows
      that hold a pickle (written by someone else) raise ``ValueError`` instead of loading;
    * the ``size`` column holds the value's length for inline values too (diskcache writes 0),
      so the tier's byte budget counts every value;
    * a file write that fails (disk full) removes its partial file before re-raising, so a
      failed write leaves nothing behind. diskcache inserts the row only after the file is
      complete, so readers never see a half-written value;
    * a row's ``filename`` that does not resolve inside the cache directory (a tampered index,
      ``../../etc/passwd`` or a symlink out) is never opened and never deleted: ``fetch`` raises
      ``BytesDisk.UnsafePathError`` and ``remove`` logs a warning and leaves the file alone. Every delete
      diskcache does (delete, overwrite, expire, evict) goes through ``remove``.
    """

    class UnsafePathError(ValueError):
        """A row names a file outside the cache directory (the index was tampered with)."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError(f"BytesDisk keys are str; got {type(key).__name__}")
        return key, True

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise ValueError("refusing to unpickle a diskcache key written by another program")
        return key

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, str | None, Any]:
        if type(value) is not bytes:
            raise TypeError(f"BytesDisk stores bytes; got {type(value).__name__}")
        if len(value) < self.min_file_size:
            return len(value), MODE_RAW, None, sqlite3.Binary(value)
        filename, full_path = self.filename(key, value)
        self.write_file(full_path, value)
        return len(value), MODE_BINARY, filename, None

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == MODE_RAW and isinstance(value, bytes | memoryview):
            return bytes(value)
        if mode == MODE_BINARY and filename is not None and not read:
            full_path = path_inside(self._directory, filename)
            if full_path is None:
                raise BytesDisk.UnsafePathError(f"its file {filename!r} lies outside {self._directory}")
            with open(full_path, "rb") as reader:
                return reader.read()
        raise ValueError(f"refusing to decode a diskcache value of mode {mode} (ragkv stores bytes only)")

    def remove(self, file_path: str) -> None:
        """Delete a value file and the subdirectories it leaves empty, never outside the directory."""
        full_path = path_inside(self._directory, file_path)
        if full_path is None:
            logger.warning(
                "disk tier %s: not deleting %r, which lies outside the tier directory (tampered index?)",
                self._directory,
                file_path,
            )
            return
        # Two processes may remove the same file or directory at once: OSError is expected.
        with contextlib.suppress(OSError):
            os.remove(full_path)
        # diskcache's os.removedirs would climb past the tier directory if it were ever empty.
        root, parent = os.path.realpath(self._directory), os.path.dirname(full_path)
        while parent != root and os.path.commonpath([root, parent]) == root:
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    def write_file(self, full_path: str, data: bytes) -> None:
        """Write ``data`` to a new file at ``full_path``; on failure leave no file behind."""
        directory = os.path.dirname(full_path)
        for attempt in range(10):
            os.makedirs(directory, exist_ok=True)
            try:
                writer = open(full_path, "xb")  # noqa: SIM115 - closed below, removed on failure
            except FileNotFoundError:
                # Another process removed the (empty) directory between makedirs and open.
                if attempt == 9:
                    raise
                continue
            try:
                with writer:
                    writer.write(data)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(full_path)
                raise
            return
