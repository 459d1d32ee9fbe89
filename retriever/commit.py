"""Committing indexed documents: catalog rows and FAISS vectors together, or neither.

The FAISS file is written inside the catalog's transaction: a failed write (a full disk) commits no
document of the batch and leaves the index as it was, so no committed document lacks its vectors.
A crash between the file's write and the catalog's commit leaves vectors the catalog does not know,
which are dropped when the index is next opened (the catalog is the truth).

The index file's lock is held from before the transaction until after its commit: another process
sharing the data directory neither writes the file meanwhile nor reads vectors whose rows it cannot
see yet (it would drop them as stale), and this copy starts from the file as saved last, by whoever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.errors import StorageWriteError
from ragkv.retriever.index import FaissIndex
from ragkv.types import Chunk

__all__ = ["commit_documents"]


def commit_documents(
    catalog: Catalog, index: FaissIndex, embedder: Any, records: Sequence[tuple[DocumentRecord, Sequence[Chunk]]]
) -> int:
    """Make each record's chunks the ones the catalog and ``index`` hold for its source, in one commit.

    Returns:
        The number of chunks committed.

    Raises:
        StorageWriteError: the FAISS file could not be written (nothing was committed).
    """
    if not records:
        return 0
    texts = [c.text for _, chunks in records for c in chunks]
    vectors = embedder.embed(texts) if texts else np.zeros((0, index.dim), dtype=np.float32)

    def write_index(removed: list[int], added: list[list[int]]) -> None:
        rows = [r for per in added for r in per]
        old = {r: index.reconstruct(r) for r in removed if r in index}
        index.remove(removed)
        if rows:
            index.add(rows, vectors)
        try:
            index.save()
        except BaseException:  # the catalog's transaction rolls back: the index goes back too
            index.remove(rows)
            if old:
                index.add(list(old), np.stack(list(old.values())))
            raise

    try:
        with index.locked():  # lock order: the index file, then the catalog's write transaction
            catalog.replace_documents(records, before_commit=write_index)
    except OSError as e:
        raise StorageWriteError(
            e.errno,
            f"could not write the FAISS index {index.path} ({e.strerror or e}); {len(records)} documents "
            "were not committed: free space (or fix the data directory's permissions) and run again",
        ) from e
    return len(texts)
