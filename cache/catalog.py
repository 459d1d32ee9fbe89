"""``Catalog``: documents, chunks and stored KV entries in SQL (SQLite file or PostgreSQL).

One catalog can be shared by several writer processes (SQLite: WAL, a busy timeout and
``BEGIN IMMEDIATE``; PostgreSQL: advisory locks) and, on PostgreSQL, several machines. A SQLite
catalog must live on a local disk (WAL needs shared memory; network filesystems break it).
Chunk row ids double as FAISS ids and are never reused.

>>> from ragkv.types import Chunk
>>> catalog = Catalog(":memory:")
>>> doc = DocumentRecord("d" * 64, "default", "notes.txt", "c" * 64, "Notes", 1)
>>> chunk = Chunk("e" * 64, "d" * 64, 0, "hello", (15, 16), "notes.txt")
>>> rows = catalog.replace_document(doc, [chunk])
>>> catalog.chunks_by_rows(rows, "default")[0].token_ids
(15, 16)
>>> catalog.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    create_engine,
    delete,
    exists,
    false,
    func,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ragkv.cache._catalog_dialects import DIALECTS, WRITE_OPTION, Dialect
from ragkv.cache.catalog_removals import CatalogRemovals
from ragkv.cache.catalog_schema import (
    ADDED_INDEXES,
    ADDED_TABLES,
    SCHEMA_VERSION,
    TABLE_NAMES,
    chunks,
    documents,
    entries,
    meta,
    metadata,
)
from ragkv.cache.document_record import DocumentRecord
from ragkv.cache.document_summary import DocumentSummary
from ragkv.cache.entry_record import EntryRecord
from ragkv.cache.keys import key_namespace
from ragkv.digests import Digest
from ragkv.errors import CatalogError
from ragkv.types import Chunk, tenant_namespace, validate_tenant

__all__ = ["Catalog", "DocumentRecord", "DocumentSummary", "EntryRecord"]

logger = logging.getLogger(__name__)

_BATCH = 500  # ids per IN (...) clause, well under every database's parameter limit
_SCHEMA_LOCK = "ragkv-catalog-schema"


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _decode_tokens(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)


def _database_url(url: str) -> str:
    """A SQLAlchemy URL; a plain path (or ``:memory:``) means a SQLite file."""
    if "://" in url:
        return url
    if url == ":memory:":
        return "sqlite://"
    return f"sqlite:///{os.path.abspath(os.path.expanduser(url))}"


def _sqlite_file(sa_url: URL) -> str | None:
    """The file of a file-backed SQLite URL, else None (in-memory SQLite, other databases)."""
    if sa_url.get_backend_name() != "sqlite" or sa_url.database in (None, "", ":memory:"):
        return None
    return os.path.abspath(os.path.expanduser(str(sa_url.database)))


class Catalog(CatalogRemovals):
    """The catalog of documents, chunks and stored entries.

    Args:
        url: a SQLAlchemy URL (``sqlite:///path/catalog.db``,
            ``postgresql+psycopg://user:pw@host/db``) or a plain path to a SQLite file.
        timeout_s: how long to wait for a connection or a lock before raising CatalogError.
        create: create the catalog (a SQLite file and its directory, the tables) if there is
            none; False for commands that only read it, so they fail instead of leaving an
            empty catalog behind.

    Raises:
        CatalogError: the database is unreachable or is not a ragkv catalog, there is no
            catalog and ``create`` is False, or its schema version is not this ragkv's.
        ValueError: an unsupported database (SQLite and PostgreSQL are supported).
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, create: bool = True) -> None:
        try:
            sa_url = make_url(_database_url(url))
        except ArgumentError as e:
            raise ValueError(f"not a database URL: {url!r}; use a path or e.g. postgresql+psycopg://...") from e
        dialect = DIALECTS.get(sa_url.get_backend_name())
        if dialect is None:
            raise ValueError(f"unsupported catalog database {sa_url.get_backend_name()!r}; use {sorted(DIALECTS)}")
        self._dialect: Dialect = dialect
        self._display = sa_url.render_as_string(hide_password=True)
        self._file = _sqlite_file(sa_url)
        self._create = create
        if self._file is not None:
            self._check_file(self._file)
        # hide_parameters: errors and logs must not carry document text or token ids.
        kwargs = {"hide_parameters": True, **dialect.engine_kwargs(timeout_s)}
        if sa_url.get_backend_name() == "sqlite" and sa_url.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool  # one shared connection, or each would get its own db
        try:
            self._engine: Engine = create_engine(sa_url, **kwargs)
        except (NoSuchModuleError, ImportError) as e:
            raise ValueError(f"no driver for {self._display}: {e} (pip install 'ragkv[postgres]')") from e
        dialect.prepare(self._engine, timeout_s)
        self._writer = self._engine.execution_options(**{WRITE_OPTION: True})
        self._init_schema()

    @property
    def url(self) -> str:
        """The database URL without its password."""
        return self._display

    # -- documents and chunks -----------------------------------------------------------------

    def get_document(self, source: str, tenant: str) -> DocumentRecord | None:
        """The document indexed from ``source`` for ``tenant``, or None."""
        validate_tenant(tenant)
        query = select(documents).where(documents.c.tenant == tenant, documents.c.source == source)
        with self._read() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else _document(row)

    def document_chunks(self, source: str, tenant: str) -> dict[int, Chunk]:
        """The chunks recorded for ``(tenant, source)``'s document, by row id, in ordinal order."""
        validate_tenant(tenant)
        owner = select(documents.c.row).where(documents.c.tenant == tenant, documents.c.source == source)
        query = select(chunks).where(chunks.c.document_row.in_(owner.scalar_subquery())).order_by(chunks.c.ordinal)
        with self._read() as conn:
            return {int(r["row"]): _chunk(r) for r in conn.execute(query).mappings()}

    def replace_document(self, doc: DocumentRecord, chunks_: Sequence[Chunk]) -> list[int]:
        """Atomically replace ``(doc.tenant, doc.source)``'s document and chunks.

        Returns:
            The row ids assigned to ``chunks_``, in order (new ids; old ones are never reused).

        Raises:
            ValueError: a chunk belongs to another document, ``doc.num_chunks`` is not the
                number of chunks given, or ``doc.tenant`` is not a valid tenant name.
        """
        return self.replace_documents([(doc, chunks_)])[0]

    def replace_documents(
        self,
        items: Sequence[tuple[DocumentRecord, Sequence[Chunk]]],
        *,
        before_commit: Callable[[list[int], list[list[int]]], None] | None = None,
    ) -> list[list[int]]:
        """Replace several documents (as :meth:`replace_document`) in one transaction.

        Args:
            items: (document, its chunks) pairs.
            before_commit: called inside the transaction with (the chunk rows removed, the rows
                assigned to each item's chunks); what it raises rolls everything back. The indexer
                writes its FAISS file here: a failed write (a full disk) commits no document.

        Returns:
            The row ids assigned to each item's chunks, in order.
        """
        for doc, chunks_ in items:
            validate_tenant(doc.tenant)
            _check_document(doc, chunks_)
        removed: list[int] = []
        added: list[list[int]] = []
        with self._write() as conn:
            for doc, chunks_ in items:
                self._dialect.lock(conn, f"document:{doc.tenant}:{doc.source}")
                removed += self._remove_document(conn, doc.source, doc.tenant)
                added.append(self._insert_document(conn, doc, chunks_))
                self._revive(conn, doc.tenant, [c.token_ids for c in chunks_])
            if before_commit is not None:
                before_commit(removed, added)
        return added

    def _insert_document(self, conn: Connection, doc: DocumentRecord, chunks_: Sequence[Chunk]) -> list[int]:
        document_row = conn.execute(
            documents.insert().returning(documents.c.row),
            {
                "doc_id": doc.doc_id,
                "tenant": doc.tenant,
                "source": doc.source,
                "content_digest": doc.content_digest,
                "title": doc.title,
                "num_chunks": doc.num_chunks,
                "updated_at": time.time(),
            },
        ).scalar_one()
        if not chunks_:
            return []
        params = [
            {
                "document_row": document_row,
                "tenant": doc.tenant,
                "doc_id": c.doc_id,
                "chunk_id": c.chunk_id,
                "ordinal": c.ordinal,
                "text": c.text,
                "token_ids": _encode_tokens(c.token_ids),
                "source": c.source or doc.source,
            }
            for c in chunks_
        ]
        inserted = conn.execute(chunks.insert().returning(chunks.c.row, sort_by_parameter_order=True), params)
        return [int(r) for r in inserted.scalars()]

    def remove_document(self, source: str, tenant: str) -> list[int]:
        """Delete ``(tenant, source)``'s document and chunks. Returns the removed chunk row ids.

        Chunk rows of ``(tenant, source)`` whose document row is gone (deleted by hand, with
        SQLite's foreign keys off) are removed too, so a re-index never leaves a second copy.
        """
        validate_tenant(tenant)
        with self._write() as conn:
            self._dialect.lock(conn, f"document:{tenant}:{source}")
            return self._remove_document(conn, source, tenant)

    def chunks_by_rows(self, rows: Sequence[int], tenant: str) -> list[Chunk]:
        """The chunks with these row ids, in the order given; unknown or other tenants' rows skipped."""
        found = self.chunk_map(rows, tenant)
        return [found[int(r)] for r in rows if int(r) in found]

    def chunk_map(self, rows: Sequence[int], tenant: str) -> dict[int, Chunk]:
        """The chunks with these row ids, by row id; unknown or other tenants' rows left out."""
        validate_tenant(tenant)
        wanted = sorted({int(r) for r in rows})
        found: dict[int, Chunk] = {}
        with self._read() as conn:
            for start in range(0, len(wanted), _BATCH):
                batch = wanted[start : start + _BATCH]
                query = select(chunks).where(chunks.c.tenant == tenant, chunks.c.row.in_(batch))
                found.update({int(r["row"]): _chunk(r) for r in conn.execute(query).mappings()})
        return found

    def chunks_for_document(self, doc_id: str, tenant: str | None = None) -> list[Chunk]:
        """A document's chunks in order.

        Args:
            doc_id: the document's id.
            tenant: whose document; None accepts any tenant as long as only one holds ``doc_id``.

        Raises:
            ValueError: ``tenant`` is None and several tenants hold a document with this id.
        """
        query = select(chunks).where(chunks.c.doc_id == doc_id)
        if tenant is not None:
            validate_tenant(tenant)
            query = query.where(chunks.c.tenant == tenant)
        with self._read() as conn:
            rows = list(conn.execute(query.order_by(chunks.c.tenant, chunks.c.ordinal)).mappings())
        tenants = {r["tenant"] for r in rows}
        if len(tenants) > 1:
            raise ValueError(f"document {doc_id} is indexed for several tenants; pass tenant=")
        return [_chunk(r) for r in rows]

    def all_chunk_rows(self, tenant: str) -> list[int]:
        """Every chunk row id of ``tenant``, ascending (to rebuild a FAISS index)."""
        validate_tenant(tenant)
        query = select(chunks.c.row).where(chunks.c.tenant == tenant).order_by(chunks.c.row)
        with self._read() as conn:
            return [int(r) for r in conn.execute(query).scalars()]

    def documents(self, tenant: str) -> list[DocumentRecord]:
        """``tenant``'s documents, by source."""
        validate_tenant(tenant)
        query = select(documents).where(documents.c.tenant == tenant).order_by(documents.c.source)
        with self._read() as conn:
            return [_document(r) for r in conn.execute(query).mappings()]

    def document_summaries(self, tenant: str) -> list[DocumentSummary]:
        """``tenant``'s documents, by source, with their chunk and token counts and index time."""
        validate_tenant(tenant)
        # token_ids is little-endian uint32 per token, so a chunk's byte length / 4 is its token count
        token_bytes = func.coalesce(func.sum(func.length(chunks.c.token_ids)), 0)
        query = (
            select(documents.c.source, documents.c.title, documents.c.num_chunks, documents.c.updated_at, token_bytes)
            .select_from(documents.outerjoin(chunks, chunks.c.document_row == documents.c.row))
            .where(documents.c.tenant == tenant)
            .group_by(documents.c.row)
            .order_by(documents.c.source)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [DocumentSummary(s, t, int(n), int(b) // 4, float(at)) for s, t, n, at, b in rows]

    # -- stored entries -----------------------------------------------------------------------

    def record_entry(
        self,
        storage_key: str,
        *,
        tenant: str,
        tokens_digest: str,
        codec: str,
        level: int,
        nbytes: int,
        num_tokens: int,
        unless_removed: bool = False,
    ) -> bool:
        """Record (or update) a stored entry. Idempotent; keeps its hit count.

        Args:
            unless_removed: refuse (return False) when the entry's chunk belongs to a removed
                document (see ``ragkv.cache.catalog_removals``): what the query path asks, whose
                request may have been queued before the removal.

        Returns:
            Whether the entry is recorded.

        Raises:
            ValueError: ``storage_key`` is malformed or is not in ``tenant``'s namespace, or
                ``tenant`` is not a valid tenant name.
        """
        validate_tenant(tenant)
        if key_namespace(storage_key) != tenant_namespace(tenant):
            raise ValueError(f"storage key {storage_key} is not in tenant {tenant!r}'s namespace")
        now = time.time()
        fields = {
            "tenant": tenant,
            "tokens_digest": tokens_digest,
            "codec": codec,
            "level": int(level),
            "nbytes": int(nbytes),
            "num_tokens": int(num_tokens),
            "last_access": now,
        }
        statement = self._dialect.insert(entries).values(storage_key=storage_key, hits=0, created_at=now, **fields)
        statement = statement.on_conflict_do_update(index_elements=[entries.c.storage_key], set_=fields)
        with self._write() as conn:
            if unless_removed and self._removed_in(conn, tenant, tokens_digest):
                return False
            conn.execute(statement)
        return True

    def has_entry(self, storage_key: str) -> bool:
        """Whether ``storage_key`` is recorded."""
        query = select(entries.c.storage_key).where(entries.c.storage_key == storage_key)
        with self._read() as conn:
            return conn.execute(query).first() is not None

    def entry_sizes(self, storage_keys: Sequence[str]) -> dict[str, int]:
        """The recorded encoded size in bytes of each of ``storage_keys`` that is recorded."""
        keys = sorted(set(storage_keys))
        found: dict[str, int] = {}
        with self._read() as conn:
            for start in range(0, len(keys), _BATCH):
                batch = keys[start : start + _BATCH]
                query = select(entries.c.storage_key, entries.c.nbytes).where(entries.c.storage_key.in_(batch))
                found.update((r.storage_key, int(r.nbytes)) for r in conn.execute(query))
        return found

    def entries(self, tenant: str) -> list[EntryRecord]:
        """``tenant``'s recorded entries, by storage key."""
        validate_tenant(tenant)
        query = select(entries).where(entries.c.tenant == tenant).order_by(entries.c.storage_key)
        with self._read() as conn:
            return [EntryRecord(**dict(r)) for r in conn.execute(query).mappings()]

    def entry_keys_for_tokens(self, tokens_digests: Sequence[str], tenant: str) -> list[str]:
        """The storage keys of ``tenant``'s entries of these chunks (token digests), at any codec, level,
        prefix or channel transform they were stored with; sorted."""
        validate_tenant(tenant)
        digests = sorted(set(tokens_digests))
        found: set[str] = set()
        with self._read() as conn:
            for start in range(0, len(digests), _BATCH):
                batch = digests[start : start + _BATCH]
                query = select(entries.c.storage_key).where(
                    and_(entries.c.tenant == tenant, entries.c.tokens_digest.in_(batch))
                )
                found.update(r.storage_key for r in conn.execute(query))
        return sorted(found)

    def remove_entry(self, storage_key: str) -> None:
        """Forget ``storage_key`` (no error if it was not recorded)."""
        with self._write() as conn:
            conn.execute(delete(entries).where(entries.c.storage_key == storage_key))

    def touch_entries(self, storage_keys: Sequence[str]) -> None:
        """Count a use of each entry: hits + 1, last_access = now. Unknown keys are ignored."""
        keys = sorted(set(storage_keys))
        if not keys:
            return
        now = time.time()
        with self._write() as conn:
            for start in range(0, len(keys), _BATCH):
                batch = keys[start : start + _BATCH]
                conn.execute(
                    update(entries)
                    .where(entries.c.storage_key.in_(batch))
                    .values(hits=entries.c.hits + 1, last_access=now)
                )

    def close(self) -> None:
        """Release the database connections."""
        self._engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog({self._display!r})"

    # -- internals ------------------------------------------------------------------------------

    def _init_schema(self) -> None:
        """Create the tables on first use; refuse a database of another schema version."""
        with self._write() as conn:
            self._dialect.lock(conn, _SCHEMA_LOCK)
            present = set(inspect(conn).get_table_names()) & TABLE_NAMES
            if meta.name in present:
                query = select(meta.c.value).where(meta.c.key == "schema_version")
                found = conn.execute(query).scalar_one_or_none()
                if found != str(SCHEMA_VERSION):
                    raise CatalogError(
                        f"catalog {self._display} has schema version {found}, this ragkv uses "
                        f"{SCHEMA_VERSION}; re-index into a new catalog (or upgrade ragkv)"
                    )
                for table in ADDED_TABLES:  # catalogs made before a table was added gain it
                    table.create(conn, checkfirst=True)
                for index in ADDED_INDEXES:  # catalogs made before an index was added gain it
                    index.create(conn, checkfirst=True)
            elif present:
                raise CatalogError(
                    f"catalog {self._display} has ragkv tables {sorted(present)} but no schema version; "
                    "it was not created by ragkv; use a new database"
                )
            elif not self._create:
                raise CatalogError(f"no ragkv catalog in {self._display}: run `ragkv index` first")
            else:
                metadata.create_all(conn)
                conn.execute(meta.insert(), {"key": "schema_version", "value": str(SCHEMA_VERSION)})

    def _check_file(self, path: str) -> None:
        """Refuse a SQLite catalog that is missing (unless creating it) or is a directory."""
        if os.path.isdir(path):
            raise CatalogError(f"the catalog path {path} is a directory; pass the catalog file inside it")
        if os.path.exists(path):
            return
        if not self._create:
            raise CatalogError(f"no catalog at {path}: run `ragkv index` first, or pass the --data-dir it was built in")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise CatalogError(f"cannot create a catalog at {path} ({e}); pass a writable --data-dir") from e

    def _remove_document(self, conn: Connection, source: str, tenant: str) -> list[int]:
        found = conn.execute(
            select(documents.c.row).where(documents.c.tenant == tenant, documents.c.source == source)
        ).scalar_one_or_none()
        # Orphans: chunk rows of this source whose document row was deleted by hand (SQLite's
        # shell runs with foreign keys off, so the cascade never ran). Left alone, every re-index
        # would add another copy beside them.
        orphaned = and_(
            chunks.c.tenant == tenant,
            chunks.c.source == source,
            ~exists().where(documents.c.row == chunks.c.document_row),  # per candidate: a primary-key probe
        )
        owned = chunks.c.document_row == found if found is not None else false()
        doomed = or_(owned, orphaned)
        rows = [int(r) for r in conn.execute(select(chunks.c.row).where(doomed).order_by(chunks.c.row)).scalars()]
        if rows:
            conn.execute(delete(chunks).where(doomed))
        if found is not None:
            conn.execute(delete(documents).where(documents.c.row == found))
        return rows

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._errors(), self._engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._errors(), self._writer.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as e:
            raise CatalogError(self._explain(e)) from e

    def _explain(self, e: SQLAlchemyError) -> str:
        """A one-line message for a database error, saying what to do about it."""
        # the driver's own message, without SQLAlchemy's "[SQL: ...]" and "(Background ...)" lines
        detail = " ".join(str(getattr(e, "orig", None) or e).split())
        if self._file is not None and ("not a database" in detail or "malformed" in detail):
            return (
                f"{self._file} is not a ragkv catalog (SQLite: {detail}); move it away, "
                "or pass another --data-dir / catalog URL"
            )
        if self._file is not None and "unable to open" in detail:
            return (
                f"cannot open the catalog at {self._file} (SQLite: {detail}); check that its "
                "directory exists and is writable, or pass another --data-dir"
            )
        return f"catalog {self._display}: {detail}; check that the database is reachable and the URL is right"


def _check_document(doc: DocumentRecord, chunks_: Sequence[Chunk]) -> None:
    if doc.num_chunks != len(chunks_):
        raise ValueError(f"document {doc.source!r} says num_chunks={doc.num_chunks} but {len(chunks_)} were given")
    strangers = [c.ordinal for c in chunks_ if c.doc_id != doc.doc_id]
    if strangers:
        raise ValueError(f"chunks {strangers} of {doc.source!r} carry another doc_id than {doc.doc_id}")


def _document(row: Any) -> DocumentRecord:
    return DocumentRecord(
        doc_id=row["doc_id"],
        tenant=row["tenant"],
        source=row["source"],
        content_digest=row["content_digest"],
        title=row["title"],
        num_chunks=int(row["num_chunks"]),
    )


def _chunk(row: Any) -> Chunk:
    return Chunk(
        chunk_id=Digest(row["chunk_id"]),
        doc_id=Digest(row["doc_id"]),
        ordinal=int(row["ordinal"]),
        text=row["text"],
        token_ids=_decode_tokens(bytes(row["token_ids"])),
        source=row["source"],
    )
