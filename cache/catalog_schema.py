"""The catalog's tables (SQLAlchemy Core).

Bump ``SCHEMA_VERSION`` with every change to a column or a constraint. An index or a table added
later goes into ``ADDED_INDEXES`` / ``ADDED_TABLES`` instead: ``Catalog`` creates it on open when it is missing, so
existing catalogs keep working (no data changes meaning, lookups just get faster).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

__all__ = ["SCHEMA_VERSION", "metadata", "meta", "documents", "chunks", "entries", "removed", "TABLE_NAMES",
           "ADDED_INDEXES", "ADDED_TABLES"]  # fmt: skip

SCHEMA_VERSION = 1

# Row ids are FAISS ids: 64-bit, never reused after a delete (SQLite AUTOINCREMENT, PostgreSQL
# identity), so a stale vector can never point at a newer chunk. SQLite needs the exact type
# INTEGER for its rowid alias.
RowId = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

meta = Table(
    "ragkv_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)

documents = Table(
    "ragkv_documents",
    metadata,
    Column("row", RowId, primary_key=True, autoincrement=True),
    Column("doc_id", String(64), nullable=False, index=True),
    Column("tenant", String(256), nullable=False),
    Column("source", Text, nullable=False),
    Column("content_digest", String(64), nullable=False),
    Column("title", Text, nullable=False),
    Column("num_chunks", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("tenant", "source", name="uq_ragkv_documents_tenant_source"),
    sqlite_autoincrement=True,
)

chunks = Table(
    "ragkv_chunks",
    metadata,
    Column("row", RowId, primary_key=True, autoincrement=True),
    Column("document_row", RowId, ForeignKey("ragkv_documents.row", ondelete="CASCADE"), nullable=False),
    Column("tenant", String(256), nullable=False),
    Column("doc_id", String(64), nullable=False),
    Column("chunk_id", String(64), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("token_ids", LargeBinary, nullable=False),  # little-endian uint32 each
    Column("source", Text, nullable=False),
    Index("ix_ragkv_chunks_document_row", "document_row"),
    Index("ix_ragkv_chunks_doc_id", "doc_id"),
    Index("ix_ragkv_chunks_tenant_row", "tenant", "row"),
    # finds a source's chunk rows whose document row is gone (Catalog._remove_document)
    Index("ix_ragkv_chunks_tenant_source", "tenant", "source"),
    sqlite_autoincrement=True,
)

entries = Table(
    "ragkv_entries",
    metadata,
    Column("storage_key", String(96), primary_key=True),
    Column("tenant", String(256), nullable=False, index=True),
    Column("tokens_digest", String(64), nullable=False, index=True),
    Column("codec", String(64), nullable=False),
    Column("level", Integer, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("num_tokens", Integer, nullable=False),
    Column("hits", BigInteger, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("last_access", Float, nullable=False),
)

# Chunks whose documents were removed (one row per tenant and token digest), until a document
# with those tokens is indexed again. The query path records no cache entry for them (a request
# queued before the removal must not bring a removed chunk's cache back), and the entries still
# recorded for them are removals a tier could not finish yet ("pending": a retry finishes them).
removed = Table(
    "ragkv_removed",
    metadata,
    Column("tenant", String(256), primary_key=True),
    Column("tokens_digest", String(64), primary_key=True),
    Column("source", Text, nullable=False),  # the document last removed with these tokens
    Column("removed_at", Float, nullable=False),
    Index("ix_ragkv_removed_tenant_source", "tenant", "source"),
)

TABLE_NAMES = frozenset(t.name for t in metadata.sorted_tables)

ADDED_TABLES = (removed,)
"""Tables added after schema version 1 shipped, created on open where missing."""

ADDED_INDEXES = tuple(i for i in chunks.indexes if i.name == "ix_ragkv_chunks_tenant_source")
"""Indexes added after schema version 1 shipped, created on open where missing."""
