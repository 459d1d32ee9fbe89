"""``ragkv check``: find, and on request repair, where the catalog, the FAISS index and the tiers disagree.

The rule they keep (docs/concepts.md, "Nothing lost, nothing resurrected"): a committed document has
its chunk rows, a vector per row and every chunk's cache in a lasting tier; a recorded entry's blob
is in some tier; no removed chunk's entry is left behind. Crashes, lost disks and hand edits can
still break it; this module says where, and repairs what it can:

* FAISS vectors without a chunk row, or rows without a vector: the index is rebuilt from the
  catalog (the truth) whenever a retriever opens it, so they are repaired by opening it;
* a committed document missing a chunk cache: the cache is computed and stored again;
* an entry whose blob no tier holds: its row is dropped (the next miss stores it again);
* pending entries of removed documents: their deletion is retried.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

from ragkv.retriever.removal import retry_pending

if TYPE_CHECKING:
    from ragkv.cache.catalog import Catalog
    from ragkv.retriever.kv_retriever import KVRetriever

logger = logging.getLogger(__name__)

__all__ = ["CheckReport", "check", "faiss_disagreement"]


@dataclass(slots=True)
class CheckReport:
    """What :func:`check` found (and, with ``repair``, what is left after repairing)."""

    documents: int = 0  # committed documents looked at
    vectors_missing: int = 0  # chunk rows without a FAISS vector (before the index was reconciled)
    vectors_stale: int = 0  # FAISS vectors without a chunk row (idem)
    caches_missing: list[str] = field(default_factory=list)  # "source#chunk" whose cache no lasting tier holds
    entries_dangling: list[str] = field(default_factory=list)  # recorded entries whose blob no tier holds
    pending: list[str] = field(default_factory=list)  # entries of removed documents still recorded
    repaired: int = 0  # problems fixed by this run (with repair=True)

    @property
    def problems(self) -> int:
        """How many disagreements were found."""
        return (
            self.vectors_missing
            + self.vectors_stale
            + len(self.caches_missing)
            + len(self.entries_dangling)
            + len(self.pending)
        )


def check(retriever: KVRetriever, *, repair: bool = False, before: tuple[int, int] = (0, 0)) -> CheckReport:
    """Check one tenant's catalog, FAISS index and stored caches against each other.

    Args:
        retriever: the tenant's retriever (opening it already reconciled its FAISS index).
        repair: recompute missing caches, drop dangling entry rows, retry pending removals.
        before: (rows without a vector, vectors without a row) found before the retriever opened
            the index, to report (see :func:`faiss_disagreement`).
    """
    catalog, tenant, store = retriever.catalog, retriever.tenant, retriever.store
    report = CheckReport(vectors_missing=before[0], vectors_stale=before[1])
    report.repaired += sum(before) if repair else 0
    docs = catalog.documents(tenant)
    report.documents = len(docs)
    for doc in docs:
        for chunk in catalog.document_chunks(doc.source, tenant).values():
            keys = [
                retriever.computer.chunk_key(chunk.token_ids, s).storage_key for s in retriever.config.stored_codecs
            ]
            if all(store.persisted(k) for k in keys):
                continue
            if repair:
                retriever.ensure(chunk.token_ids)  # computed, stored and recorded, if a tier takes it
                if all(store.persisted(k) for k in keys):
                    report.repaired += 1
                    continue
            report.caches_missing.append(f"{doc.source}#{chunk.ordinal}")
    pending = {e.storage_key for e in catalog.pending_entries(tenant)}
    for entry in catalog.entries(tenant):
        if entry.storage_key in pending or store.contains(entry.storage_key):
            continue
        if repair:
            catalog.remove_entry(entry.storage_key)
            report.repaired += 1
        else:
            report.entries_dangling.append(entry.storage_key)
    if repair:
        report.repaired += retry_pending(retriever)[0]
    report.pending = [e.storage_key for e in catalog.pending_entries(tenant)]
    return report


def faiss_disagreement(catalog: Catalog, tenant: str, path: Path) -> tuple[int, int]:
    """(catalog rows without a vector, vectors without a row) of the FAISS file at ``path``, read as
    it is on disk (before a retriever opens, and so reconciles, it). (0, 0) when there is no file."""
    if not path.is_file():
        return len(catalog.all_chunk_rows(tenant)), 0
    raw: Any = faiss.deserialize_index(np.fromfile(path, dtype=np.uint8))
    have = {int(i) for i in faiss.vector_to_array(raw.id_map)}
    rows = set(catalog.all_chunk_rows(tenant))
    return len(rows - have), len(have - rows)
