"""``DocumentRecord``: one indexed document, as the catalog stores it; ``DocumentSummary``: how it is listed."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DocumentRecord", "DocumentSummary"]


@dataclass(frozen=True, slots=True)
class DocumentRecord:
    """A document of one tenant; ``(tenant, source)`` is unique in the catalog."""

    doc_id: str  # digest of the document's source and content (Chunk.doc_id of its chunks)
    tenant: str  # owner; tenants never see each other's documents
    source: str  # where it came from (path, URL or name); re-indexing the same source replaces it
    content_digest: str  # digest of the content, to tell whether a re-index is needed
    title: str  # display title
    num_chunks: int  # chunks stored for it


@dataclass(frozen=True, slots=True)
class DocumentSummary:
    """One line of ``ragkv list``: a document with its sizes, read from the catalog alone."""

    source: str  # where it came from (path, URL or name), as indexed
    title: str  # display title
    num_chunks: int  # chunks stored for it
    num_tokens: int  # generator tokens over its chunks (what its caches hold)
    indexed_at: float  # unix time of its last (re-)index
