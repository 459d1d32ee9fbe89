"""Removing a document: its catalog rows and FAISS vectors, then the stored caches no other document uses.

The rule (docs/concepts.md, "Nothing lost, nothing resurrected"): the removed chunks are marked in
the catalog before their entries are listed, so a request queued before the removal cannot record
a recomputed cache after it; an entry's catalog row is dropped only once its blob is gone from every
tier, otherwise it stays *pending* and removing the same source again finishes the job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ragkv.digests import tokens_digest
from ragkv.errors import DocumentNotFoundError
from ragkv.retriever.records import RemoveReport
from ragkv.types import CodecSpec

if TYPE_CHECKING:
    from ragkv.retriever.kv_retriever import KVRetriever

logger = logging.getLogger(__name__)

__all__ = ["RemoveReport", "forget_chunks", "live_token_ids", "remove_document", "retry_pending"]


def remove_document(retriever: KVRetriever, source: str) -> RemoveReport:
    """Forget ``source`` of the retriever's tenant (see :meth:`KVRetriever.remove_document`).

    A source with no document but pending entries (an earlier removal a tier could not finish) is
    removed again: its pending entries are deleted now if the tiers allow.

    Raises:
        DocumentNotFoundError: no such document and nothing pending for it.
    """
    tenant, catalog = retriever.tenant, retriever.catalog
    # a file is indexed under its resolved path: accept the path as typed too
    names = list(dict.fromkeys([source.strip(), str(Path(source.strip()).expanduser().resolve())]))
    found = [n for n in names if n and catalog.get_document(n, tenant) is not None]
    if not found:
        pending = [n for n in names if n and catalog.pending_entries(tenant, n)]
        if not pending:
            raise DocumentNotFoundError(f"no document {source.strip()!r} in tenant {tenant!r} (list them: ragkv list)")
        deleted, left = retry_pending(retriever, pending[0])
        return RemoveReport(source=pending[0], chunks=0, cache_entries=deleted, pending=left)
    source = found[0]
    chunks = catalog.document_chunks(source, tenant)
    rows = catalog.remove_document(source, tenant)
    if rows:
        retriever.index.remove(rows)
        retriever.index.save()
    deleted, left = forget_chunks(retriever, source, [c.token_ids for c in chunks.values()])
    return RemoveReport(source=source, chunks=len(rows), cache_entries=deleted, pending=left)


def live_token_ids(retriever: KVRetriever) -> set[tuple[int, ...]]:
    """The token ids of every chunk the tenant's catalog indexes now."""
    catalog, tenant = retriever.catalog, retriever.tenant
    return {c.token_ids for c in catalog.chunks_by_rows(catalog.all_chunk_rows(tenant), tenant)}


def forget_chunks(
    retriever: KVRetriever,
    source: str,
    token_ids: Iterable[tuple[int, ...]],
    live: set[tuple[int, ...]] | None = None,
) -> tuple[int, int]:
    """Delete the caches of the chunks ``token_ids`` that ``source`` had (removed, or replaced by a
    new version) and that no indexed chunk of the tenant still has; returns (entries deleted,
    entries pending).

    Called after the catalog dropped ``source``'s old chunk rows. The chunks are marked removed before
    their entries are listed, so a query-path record after this point is refused. ``live``: the
    tenant's indexed chunks (:func:`live_token_ids`), when the caller has them for several sources.
    """
    catalog, tenant = retriever.catalog, retriever.tenant
    gone = set(token_ids)
    if not gone:
        return 0, 0
    gone -= live_token_ids(retriever) if live is None else live
    if not gone:
        return 0, 0
    catalog.mark_removed(source, tenant, [tokens_digest(ids) for ids in gone])
    # keys made now (an entry stored but never recorded goes too), then whatever the catalog recorded
    made: dict[str, tuple[tuple[int, ...], CodecSpec]] = {
        retriever.computer.chunk_key(ids, spec).storage_key: (ids, spec)
        for ids in gone
        for spec in retriever.config.stored_codecs
    }
    recorded = catalog.entry_keys_for_tokens([tokens_digest(ids) for ids in gone], tenant)
    return _delete_entries(retriever, sorted(set(made) | set(recorded)), made)


def retry_pending(retriever: KVRetriever, source: str | None = None) -> tuple[int, int]:
    """Delete the pending entries of removed documents (of ``source`` only, if given), now, if the
    tiers allow; live documents are left alone. Returns (entries deleted, entries still pending)."""
    keys = [e.storage_key for e in retriever.catalog.pending_entries(retriever.tenant, source)]
    return _delete_entries(retriever, keys, {})


def _delete_entries(
    retriever: KVRetriever, keys: list[str], made: dict[str, tuple[tuple[int, ...], CodecSpec]]
) -> tuple[int, int]:
    """Delete ``keys`` from every tier; drop the catalog row of each one gone everywhere, keep (or
    add) it for the others. Returns (entries deleted, entries pending)."""
    catalog, tenant = retriever.catalog, retriever.tenant
    recorded = set(catalog.entry_sizes(keys))
    deleted = pending = 0
    device_tier, host_tier = retriever.loader.device_tier, retriever.loader.host_tier
    for key in keys:
        # this process's decoded copies go first (GPU, pinned host memory): never served again
        if device_tier is not None:
            device_tier.discard(key)
        if host_tier is not None:  # also cancels an admission still waiting for the tier's worker
            host_tier.discard(key)
        found, gone = retriever.store.erase(key)
        deleted += found and gone
        if gone:
            catalog.remove_entry(key)
            continue
        pending += 1
        if key not in recorded and key in made:  # an unrecorded blob a tier kept: recorded, so a retry sees it
            ids, spec = made[key]
            catalog.record_entry(
                key,
                tenant=tenant,
                tokens_digest=tokens_digest(ids),
                codec=spec.name,
                level=spec.level,
                nbytes=0,
                num_tokens=len(ids),
            )
    if pending:
        logger.warning(
            "%d cache entries could not be deleted from every tier (read-only or unavailable); they stay in the "
            "catalog as pending: remove the document again once the tiers can delete",
            pending,
        )
    return deleted, pending
