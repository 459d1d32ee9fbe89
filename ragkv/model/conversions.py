"""The conversion cache: a GGUF file is de-quantized once per (content, dtype, converter), then memory-mapped.

transformers de-quantizes a GGUF file on every load (30-160 s, several GB of peak memory). The first
load writes the converted model (safetensors, config, tokenizer) into an entry of this cache; every
later process, on this machine or any that shares the folder, loads the entry in seconds.

Layout under the cache root (``RAGKV_MODEL_CACHE``, default ``~/.cache/ragkv/models``)::

    <name>-<dtype>-<key12>/      one entry: config.json, model.safetensors, tokenizer files
        manifest.json            the key it was built for, its source, dtype and size
        last_used                touched on every load (its mtime is the entry's last use)
    .digests.json                file digests memoized by (path, size, mtime, inode)
    .locks/<key>.lock            held while an entry is being built

An entry is used only when its manifest's key equals the key asked for, so a conversion made in
another dtype, from another file or by another converter version is never loaded in its place (the
bug this fixes: a bf16 conversion written by ``make demo`` was later loaded where fp32 was asked,
and Ray workers disagreed with their driver). Writes go to a temporary folder renamed into place
under a file lock: two processes converting at once leave one good entry, and a crash leaves none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ragkv.digests import fields_digest

logger = logging.getLogger(__name__)

__all__ = ["CONVERTER_VERSION", "CachedModel", "ConversionKey", "ModelCache"]

CONVERTER_VERSION = 2
"""Bump when the conversion's output changes: entries of other versions are rebuilt, never reused."""

_MANIFEST = "manifest.json"
_LAST_USED = "last_used"
_DIGESTS = ".digests.json"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class ConversionKey:
    """What an entry was built from: two loads share an entry only when every field is equal."""

    source_digest: str  # sha256 of the source file's bytes
    dtype: str  # torch dtype name of the stored weights: "float32", "bfloat16", "float16"
    converter: int = CONVERTER_VERSION

    @property
    def digest(self) -> str:
        return fields_digest([("source", self.source_digest), ("dtype", self.dtype), ("converter", self.converter)])


@dataclass(frozen=True, slots=True)
class CachedModel:
    """One entry of the cache, as ``ragkv models`` lists it."""

    path: Path  # the entry's folder (a model directory transformers loads)
    name: str  # the alias or file name it was converted from
    source: str  # the source file's path at conversion time
    dtype: str  # dtype of the stored weights
    size_bytes: int  # bytes on disk
    created: float  # unix time of the conversion
    last_used: float  # unix time of the last load
    key: ConversionKey


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class ModelCache:
    """Converted models under one root folder (see the module docstring for the layout).

    Args:
        root: the cache folder; created on first write.
        max_bytes: after each conversion, least recently used entries are removed until the cache
            fits (the entry just built is kept even if it alone is larger). None: no cap.
    """

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes

    # ---- digests -------------------------------------------------------------------------------
    def file_digest(self, path: str | Path) -> str:
        """sha256 of a file's bytes, memoized by (resolved path, size, mtime, inode).

        Hashing a 1 GB file takes seconds; an unchanged file (same size, mtime and inode) is not
        hashed again. A file rewritten in place gets a new mtime and is hashed anew.
        """
        path = Path(path).resolve()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        memo_path = self.root / _DIGESTS
        memo = self._read_json(memo_path) or {}
        hit = memo.get(str(path))
        if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
            return str(hit["sha256"])
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = h.hexdigest()
        memo[str(path)] = {"stamp": stamp, "sha256": digest}
        with contextlib.suppress(OSError):  # a read-only cache only costs the next hash
            self._write_json(memo_path, memo)
        return digest

    # ---- entries -------------------------------------------------------------------------------
    def lookup(self, key: ConversionKey) -> Path | None:
        """The entry built for ``key``, marked as used now; None when there is none or it does not match."""
        for entry in self._entries_for(key):
            self._touch(entry)
            return entry
        return None

    def convert(self, key: ConversionKey, build: Callable[[Path], None], *, name: str, source: str) -> Path:
        """Return the entry for ``key``, building it with ``build(folder)`` unless another process did.

        ``build`` writes a model directory (``save_pretrained``) into the folder it is given. It
        runs under a per-key file lock, in a temporary folder renamed into place when complete.

        Raises:
            OSError: the cache folder cannot be written (the caller may convert in memory instead).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock(key):
            found = self.lookup(key)  # another process may have finished while we waited
            if found is not None:
                return found
            final = self.root / f"{_slug(name)}-{key.dtype}-{key.digest[:12]}"
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=_TMP_PREFIX))
            tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by other users
            try:
                build(tmp)
                manifest = {
                    "name": name,
                    "source": source,
                    "key": asdict(key),
                    "created": time.time(),
                    "size_bytes": _dir_bytes(tmp),
                }
                self._write_json(tmp / _MANIFEST, manifest)
                (tmp / _LAST_USED).touch()
                if final.exists():  # a stale entry under the same name (e.g. a damaged one): replace it
                    shutil.rmtree(final)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s (%s) into %s", name, key.dtype, final)
        if self.max_bytes is not None:
            self.prune(max_bytes=self.max_bytes, keep=final)
        return final

    def entries(self) -> list[CachedModel]:
        """Every complete entry, most recently used first. Half-written folders are not entries."""
        out: list[CachedModel] = []
        if not self.root.is_dir():
            return out
        for folder in self.root.iterdir():
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            entry = self._read_entry(folder)
            if entry is not None:
                out.append(entry)
        return sorted(out, key=lambda e: e.last_used, reverse=True)

    def remove(self, entry: CachedModel) -> None:
        """Delete one entry (a process that memory-mapped it keeps its mapping until it exits)."""
        with self._lock(entry.key):
            shutil.rmtree(entry.path, ignore_errors=True)

    def prune(
        self, *, name: str | None = None, max_bytes: int | None = None, keep: Path | None = None
    ) -> list[CachedModel]:
        """Remove entries: those converted from ``name`` (alias, file name or source path), and/or the
        least recently used ones until the rest fit in ``max_bytes``. Returns what was removed.

        Leftovers of interrupted conversions (temporary folders older than an hour) go too.
        """
        if name is None and max_bytes is None:
            raise ValueError("say what to prune: a model name, a size cap, or both")
        self._remove_stale_tmp()
        removed = []
        kept = []
        for entry in self.entries():
            if name is not None and name in (entry.name, entry.source, Path(entry.source).name, entry.path.name):
                removed.append(entry)
            else:
                kept.append(entry)
        if max_bytes is not None:
            total = sum(e.size_bytes for e in kept)
            for entry in reversed(kept):  # least recently used first
                if total <= max_bytes:
                    break
                if keep is not None and entry.path == keep:
                    continue
                removed.append(entry)
                total -= entry.size_bytes
        for entry in removed:
            self.remove(entry)
            logger.info("removed converted model %s (%s, %d bytes)", entry.name, entry.dtype, entry.size_bytes)
        return removed

    # ---- internals -----------------------------------------------------------------------------
    def _entries_for(self, key: ConversionKey) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for folder in self.root.glob(f"*-{key.dtype}-{key.digest[:12]}"):
            entry = self._read_entry(folder)
            if entry is not None and entry.key == key:
                yield folder

    def _read_entry(self, folder: Path) -> CachedModel | None:
        manifest = self._read_json(folder / _MANIFEST)
        if not isinstance(manifest, dict) or not (folder / "config.json").is_file():
            return None
        try:
            key = ConversionKey(**manifest["key"])
            last = folder / _LAST_USED
            return CachedModel(
                path=folder,
                name=str(manifest["name"]),
                source=str(manifest["source"]),
                dtype=key.dtype,
                size_bytes=int(manifest["size_bytes"]),
                created=float(manifest["created"]),
                last_used=last.stat().st_mtime if last.exists() else float(manifest["created"]),
                key=key,
            )
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("ignoring %s: its manifest is not one this version writes (%s)", folder, e)
            return None

    def _remove_stale_tmp(self, older_than_s: float = 3600.0) -> None:
        if not self.root.is_dir():
            return
        now = time.time()
        for folder in self.root.glob(f"{_TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if now - folder.stat().st_mtime > older_than_s:
                    shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _touch(entry: Path) -> None:
        with contextlib.suppress(OSError):  # a read-only cache still loads
            (entry / _LAST_USED).touch()

    @contextlib.contextmanager
    def _lock(self, key: ConversionKey) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with (locks / f"{key.digest[:32]}.lock").open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @staticmethod
    def _read_json(path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _write_json(path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)


def _slug(name: str) -> str:
    stem = Path(name).name.removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:64] or "model"
