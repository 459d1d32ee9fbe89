"""A persistent FAISS inner-product index over int64 ids.

Vectors are expected L2-normalized (as every ``Embedder`` returns them), so inner product is
cosine similarity. The index file is written atomically (temp file, fsync, ``os.replace``), and a
sidecar ``<index>.meta.json`` records the dimension and the embedder fingerprint, so opening an
index with a different embedder fails loudly instead of returning nonsense neighbours.

Several processes may share one index file (two servers on one data directory): each holds a copy in
memory, and a save wrote that copy over the others' additions and brought back what they had removed
(found by issue 33's faults). Now every writer takes ``<index>.lock`` (``flock``, exclusive), re-reads
the file if another process replaced it since, re-applies its own changes not yet saved on top, and
writes the result; a search re-reads a replaced file first (under the lock, shared, so it never sees
a commit in flight). The indexer holds the lock across its catalog transaction (see
:mod:`ragkv.retriever.commit`), so what another process reads is committed or a crash's leftover.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ragkv.digests import Digest
from ragkv.errors import RagkvError

__all__ = ["FaissIndex", "digest_to_id", "META_SUFFIX"]

logger = logging.getLogger(__name__)

META_SUFFIX = ".meta.json"
_META_VERSION = 1
_MAX_ID = 2**63 - 1
LOCK_SUFFIX = ".lock"

# (inode, mtime_ns, size) of the index file: a save replaces the file, so any save changes it
_Stamp = tuple[int, int, int]
# a change not yet saved, re-applied on top of a file another process wrote: (ids, vectors or None to remove)
_Change = tuple[np.ndarray, np.ndarray | None]


def digest_to_id(digest: Digest | str) -> int:
    """A non-negative int64 index id from a hex digest (its first 60 bits).

    >>> digest_to_id("f" * 64) == 2**60 - 1
    True
    """
    return int(digest[:15], 16)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mismatch(path: Path, what: str) -> ValueError:
    return ValueError(
        f"the index at {path} was built with another embedder ({what}). Searching it with this "
        f"embedder would return meaningless neighbours. Re-index: delete {path} and {path}{META_SUFFIX} "
        "(or use a new data directory), or open it with the embedder it was built with."
    )


class FaissIndex:
    """Exact inner-product search (``IndexIDMap2(IndexFlatIP(dim))``) with add, remove and persistence.

    Methods are safe to call from several threads.

    Args:
        dim: Vector length.
        path: Where ``save()`` writes the index; None for an in-memory index.
        fingerprint: The embedder's fingerprint, recorded in the sidecar and checked on load.
    """

    def __init__(self, dim: int, path: Path | str | None = None, *, fingerprint: str = "") -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int (the embedder's dim); got {dim!r}")
        self.dim = dim
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self._index: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._ids: set[int] = set()  # mirror of the stored ids, for O(1) membership
        self._lock = threading.RLock()
        self._stamp: _Stamp | None = None  # the file this copy was last read from or written to
        self._unsaved: list[_Change] = []  # changes since then, in order
        self._held = 0  # depth of locked() on this object (the file lock is taken once)

    def __repr__(self) -> str:
        return f"FaissIndex(dim={self.dim}, path={self.path}, size={len(self)})"

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def __contains__(self, id_: object) -> bool:
        return isinstance(id_, int | np.integer) and int(id_) in self._ids

    def ids(self) -> list[int]:
        """Stored ids, in insertion order."""
        with self._lock:
            return [int(i) for i in faiss.vector_to_array(self._index.id_map)]

    # -- mutation --------------------------------------------------------------------------------

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add vectors under new ids.

        Args:
            ids: One id per row, unique, in ``[0, 2**63)`` (``digest_to_id`` makes one from a digest).
            vectors: float ``[len(ids), dim]``, L2-normalized.

        Raises:
            ValueError: On a shape mismatch, non-finite values, or an id that is already stored
                (``remove`` it first to replace its vector).
        """
        id_arr = self._check_ids(ids)
        vecs = np.asarray(vectors, dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape != (len(id_arr), self.dim):
            raise ValueError(f"vectors must be [len(ids)={len(id_arr)}, dim={self.dim}]; got {tuple(vecs.shape)}")
        if not np.isfinite(vecs).all():
            raise ValueError("vectors contain NaN or infinity; check the embedder's output")
        if len(set(id_arr.tolist())) != len(id_arr):
            raise ValueError("ids must be unique within one add() call")
        with self._lock:
            present = [i for i in id_arr.tolist() if i in self._ids]
            if present:
                raise ValueError(
                    f"{len(present)} id(s) already in the index (first: {present[0]}); "
                    "remove() them first to replace their vectors"
                )
            self._index.add_with_ids(np.ascontiguousarray(vecs), id_arr)
            self._ids.update(id_arr.tolist())
            if self.path is not None:
                self._unsaved.append((id_arr, np.array(vecs, dtype=np.float32)))

    def remove(self, ids: Iterable[int]) -> int:
        """Remove ids; absent ids are ignored.

        Returns:
            How many vectors were removed.
        """
        id_arr = self._check_ids(list(ids))
        if not len(id_arr):
            return 0
        with self._lock:
            removed = int(self._index.remove_ids(faiss.IDSelectorBatch(id_arr)))
            self._ids.difference_update(id_arr.tolist())
            if self.path is not None:
                self._unsaved.append((id_arr, None))
            return removed

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be a flat sequence of ints; got dtype {arr.dtype}, shape {arr.shape}")
        if (arr < 0).any() or (arr > _MAX_ID).any():
            raise ValueError("ids must be in [0, 2**63); derive them with digest_to_id(digest)")
        return arr.astype(np.int64)

    # -- search ----------------------------------------------------------------------------------

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]] | list[list[tuple[int, float]]]:
        """The ``k`` nearest stored vectors by inner product, best first.

        Args:
            query: ``[dim]`` for one query, or ``[n, dim]`` for a batch.
            k: How many neighbours (fewer come back if the index holds fewer).

        Returns:
            ``[(id, score), ...]`` for a ``[dim]`` query; one such list per row for ``[n, dim]``.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1; got {k}")
        self.refresh()  # another process may have saved since (a second server on this data directory)
        q = np.asarray(query, dtype=np.float32)
        single = q.ndim == 1
        if single:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(
                f"query must be [dim={self.dim}] or [n, dim={self.dim}]; got {tuple(np.shape(query))}. "
                "Was it embedded with the same embedder as the index?"
            )
        with self._lock:
            if len(self) == 0:
                results: list[list[tuple[int, float]]] = [[] for _ in range(len(q))]
            else:
                scores, ids = self._index.search(np.ascontiguousarray(q), min(k, len(self)))
                results = [
                    [(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i != -1]
                    for row_ids, row_scores in zip(ids, scores, strict=True)
                ]
        return results[0] if single else results

    def reconstruct(self, id_: int) -> np.ndarray:
        """The stored vector of ``id_`` (``[dim]`` float32); KeyError if absent."""
        with self._lock:
            if id_ not in self._ids:
                raise KeyError(id_)
            return np.asarray(self._index.reconstruct(int(id_)), dtype=np.float32)

    # -- persistence -----------------------------------------------------------------------------

    def save(self) -> None:
        """Write the index and its sidecar atomically to ``self.path``.

        Under the file lock: what another process saved since this copy was read is kept (the file is
        re-read and this copy's changes re-applied on top), then the result is written.
        """
        if self.path is None:
            raise ValueError("this FaissIndex has no path; create it with FaissIndex(dim, path) to save it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": _META_VERSION, "dim": self.dim, "fingerprint": self.fingerprint, "metric": "ip"}
        with self.locked(), self._lock:
            # serialize_index gives the same bytes faiss.write_index writes, but in memory, so the
            # temp file can be fsynced before it replaces the old index.
            data = faiss.serialize_index(self._index).tobytes()
            # The sidecar never changes after creation; writing it first means a crash in between
            # leaves a matching pair.
            _atomic_write(_meta_path(self.path), json.dumps(meta, sort_keys=True).encode("utf-8"))
            _atomic_write(self.path, data)
            self._stamp, self._unsaved = _stamp(self.path), []
        logger.debug("saved %d vectors to %s", len(self), self.path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the index file's lock (exclusive, across processes) with this copy up to date with the
        file; re-entrant. A writer that must keep other processes from reading the file until its
        catalog transaction commits holds it across the transaction."""
        if self.path is None:
            yield
            return
        with self._lock:
            if self._held:
                self._held += 1
                try:
                    yield
                finally:
                    self._held -= 1
                return
            with _file_lock(self.path, fcntl.LOCK_EX):
                self._held = 1
                try:
                    self._reread(self.path)
                    yield
                finally:
                    self._held = 0

    def refresh(self) -> bool:
        """Re-read the file if another process replaced it since this copy last read or wrote it,
        keeping this copy's unsaved changes. Returns whether it was re-read. Cheap when nothing changed
        (one ``stat``)."""
        if self.path is None or _stamp(self.path) == self._stamp:
            return False
        with self._lock:
            if self._held:
                return self._reread(self.path)
            with _file_lock(self.path, fcntl.LOCK_SH):  # a writer in its commit holds it exclusively
                return self._reread(self.path)

    def _reread(self, path: Path) -> bool:
        """Load ``path`` (this index's file) if it changed (the caller holds the file lock), then
        re-apply ``_unsaved``."""
        stamp = _stamp(path)
        if stamp == self._stamp or stamp is None:
            return False
        raw = _read_faiss(path)
        if raw.d != self.dim or not isinstance(raw, faiss.IndexIDMap2):
            raise _mismatch(path, f"another process wrote a {type(raw).__name__} of dim {raw.d}")
        ids = {int(i) for i in faiss.vector_to_array(raw.id_map)}
        for id_arr, vecs in self._unsaved:
            if vecs is None:
                raw.remove_ids(faiss.IDSelectorBatch(id_arr))
                ids.difference_update(id_arr.tolist())
                continue
            new = np.array([i not in ids for i in id_arr.tolist()], dtype=bool)
            if new.any():
                raw.add_with_ids(np.ascontiguousarray(vecs[new]), id_arr[new])
                ids.update(id_arr[new].tolist())
        self._index, self._ids, self._stamp = raw, ids, stamp
        logger.debug("re-read %s (saved by another process): %d vectors", path, len(ids))
        return True

    @classmethod
    def load(cls, path: Path | str, dim: int, *, fingerprint: str | None = None) -> FaissIndex:
        """Load a saved index, checking it matches the caller's embedder.

        Args:
            path: The index file.
            dim: The caller's embedding size.
            fingerprint: The caller's embedder fingerprint; None skips that check.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            ValueError: If the index was built with a different dimension or embedder.
            RagkvError: If the file is not a readable FAISS index.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no FAISS index at {path}; use FaissIndex.open() to create one")
        meta = _read_meta(path)
        if meta and meta.get("dim") != dim:
            raise _mismatch(path, f"dim {meta.get('dim')}, this one has dim {dim}")
        stored_fp = meta.get("fingerprint") if meta else None
        if fingerprint is not None and stored_fp is not None and stored_fp != fingerprint:
            raise _mismatch(path, f"fingerprint {stored_fp!r}, this one is {fingerprint!r}")
        stamp = _stamp(path)
        raw = _read_faiss(path)
        if raw.d != dim:
            raise _mismatch(path, f"dim {raw.d}, this one has dim {dim}")
        if not isinstance(raw, faiss.IndexIDMap2):
            raise RagkvError(f"{path} holds a {type(raw).__name__}, not a ragkv index; delete it and re-index")
        index = cls(dim, path, fingerprint=fingerprint if fingerprint is not None else (stored_fp or ""))
        index._index = raw
        index._ids = {int(i) for i in faiss.vector_to_array(raw.id_map)}
        index._stamp = stamp
        if meta is None:
            logger.warning("%s has no sidecar %s; assuming it matches this embedder", path, META_SUFFIX)
        return index

    @classmethod
    def open(cls, path: Path | str, dim: int, *, fingerprint: str | None = None) -> FaissIndex:
        """Load the index at ``path``, or create an empty one there if there is none (nothing is written
        until ``save()``)."""
        path = Path(path)
        if path.exists():
            return cls.load(path, dim, fingerprint=fingerprint)
        return cls(dim, path, fingerprint=fingerprint or "")


def _read_faiss(path: Path) -> Any:
    try:
        return faiss.deserialize_index(np.fromfile(path, dtype=np.uint8))
    except Exception as e:  # faiss raises RuntimeError with a C++ message
        raise RagkvError(f"{path} is not a readable FAISS index ({e}); delete it and re-index the documents") from e


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@contextlib.contextmanager
def _file_lock(path: Path, mode: int) -> Iterator[None]:
    """``flock`` ``<path>.lock`` (created if missing) in ``mode`` until the block ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + META_SUFFIX)


def _read_meta(path: Path) -> dict[str, Any] | None:
    meta_path = _meta_path(path)
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RagkvError(f"{meta_path} is unreadable ({e}); delete it and {path}, then re-index") from e
    if not isinstance(meta, dict):
        raise RagkvError(f"{meta_path} is not a ragkv index sidecar; delete it and {path}, then re-index")
    return meta
