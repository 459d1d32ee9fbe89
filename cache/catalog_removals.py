"""What the catalog keeps about removed documents: their chunks' token digests ("removed" rows).

A removed chunk stays marked until a document with the same tokens is indexed again. While it is:

* the query path records no cache entry for it (``Catalog.record_entry(..., unless_removed=True)``
  refuses): a request queued before the removal, that recomputes the chunk after it, must not
  bring its cache back where no ``remove`` reaches it (issue 33);
* an entry still recorded for it is a removal a tier could not finish (read-only, down): it is
  *pending*, and removing the same source again (or ``ragkv check --repair``) finishes it.

Marking and recording take the same per-tenant lock, so an entry is either recorded before the
mark (and the removal, which lists entries after marking, deletes it) or refused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Connection, and_, delete, exists, select

from ragkv.cache.catalog_schema import entries, removed
from ragkv.cache.entry_record import EntryRecord
from ragkv.digests import tokens_digest
from ragkv.types import validate_tenant

if TYPE_CHECKING:
    from ragkv.cache._catalog_dialects import Dialect

__all__ = ["CatalogRemovals", "entries_lock"]

_BATCH = 500


def entries_lock(tenant: str) -> str:
    """The lock name serializing a tenant's removal marks against its query-path entry records."""
    return f"entries:{tenant}"


class CatalogRemovals:
    """The ``Catalog`` methods about removed chunks (a mixin: it uses the catalog's connections)."""

    if TYPE_CHECKING:
        _dialect: Dialect

        def _read(self) -> contextlib.AbstractContextManager[Connection]: ...

        def _write(self) -> contextlib.AbstractContextManager[Connection]: ...

    def mark_removed(self, source: str, tenant: str, tokens_digests: Sequence[str]) -> None:
        """Mark the chunks ``tokens_digests`` of ``tenant``'s removed document ``source`` as removed."""
        validate_tenant(tenant)
        digests = sorted(set(tokens_digests))
        if not digests:
            return
        now = time.time()
        with self._write() as conn:
            self._dialect.lock(conn, entries_lock(tenant))
            for start in range(0, len(digests), _BATCH):
                rows = [
                    {"tenant": tenant, "tokens_digest": d, "source": source, "removed_at": now}
                    for d in digests[start : start + _BATCH]
                ]
                statement = self._dialect.insert(removed).values(rows)
                statement = statement.on_conflict_do_update(
                    index_elements=[removed.c.tenant, removed.c.tokens_digest],
                    set_={"source": statement.excluded.source, "removed_at": statement.excluded.removed_at},
                )
                conn.execute(statement)

    def is_removed(self, tenant: str, tokens_digest: str) -> bool:
        """Whether ``tenant``'s chunk ``tokens_digest`` belongs to a removed document (and no indexed one)."""
        validate_tenant(tenant)
        query = select(removed.c.tokens_digest).where(
            removed.c.tenant == tenant, removed.c.tokens_digest == tokens_digest
        )
        with self._read() as conn:
            return conn.execute(query).first() is not None

    def pending_entries(self, tenant: str, source: str | None = None) -> list[EntryRecord]:
        """Entries still recorded for removed chunks (of ``source`` only, if given): removals a tier
        could not finish. Removing the source again (or ``ragkv check --repair``) retries them."""
        validate_tenant(tenant)
        marked = and_(removed.c.tenant == entries.c.tenant, removed.c.tokens_digest == entries.c.tokens_digest)
        if source is not None:
            marked = and_(marked, removed.c.source == source)
        query = select(entries).where(entries.c.tenant == tenant, exists().where(marked))
        with self._read() as conn:
            return [EntryRecord(**dict(r)) for r in conn.execute(query.order_by(entries.c.storage_key)).mappings()]

    def pending_sources(self, tenant: str) -> list[str]:
        """The removed sources of ``tenant`` that still have pending entries, sorted."""
        validate_tenant(tenant)
        held = and_(entries.c.tenant == tenant, entries.c.tokens_digest == removed.c.tokens_digest)
        query = select(removed.c.source).distinct().where(removed.c.tenant == tenant, exists().where(held))
        with self._read() as conn:
            return sorted(str(s) for s in conn.execute(query).scalars())

    def _removed_in(self, conn: Connection, tenant: str, tokens_digest: str) -> bool:
        """Inside a write: take the tenant's entries lock; whether the chunk is marked removed."""
        self._dialect.lock(conn, entries_lock(tenant))
        query = select(removed.c.tokens_digest).where(
            removed.c.tenant == tenant, removed.c.tokens_digest == tokens_digest
        )
        return conn.execute(query).first() is not None

    def _revive(self, conn: Connection, tenant: str, token_ids: Sequence[Sequence[int]]) -> None:
        """Inside a write: chunks indexed again are no longer removed."""
        digests = sorted({tokens_digest(t) for t in token_ids})
        for start in range(0, len(digests), _BATCH):
            batch = digests[start : start + _BATCH]
            conn.execute(delete(removed).where(removed.c.tenant == tenant, removed.c.tokens_digest.in_(batch)))
