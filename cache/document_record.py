"""``DocumentRecord``: one indexed document, as the catalog stores it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DocumentRecord"]


@dataclass(frozen=True, slots=True)
class DocumentRecord:
    """A document of one tenant; ``(tenant, source)`` is unique in the catalog."""

    doc_id: str  # digest of the document's source and content (Chunk.doc_id of its chunks)
    tenant: str  # owner; tenants never see each other's documents
    source: str  # where it came from (path, URL or name); re-indexing the same source replaces it
    content_digest: str  # digest of the content, to tell whether a re-index is needed
    title: str  # display title
    num_chunks: int  # chunks stored for it
