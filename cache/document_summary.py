"""``DocumentSummary``: how an indexed document is listed (``ragkv list``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DocumentSummary"]


@dataclass(frozen=True, slots=True)
class DocumentSummary:
    """One line of ``ragkv list``: a document with its sizes, read from the catalog alone."""

    source: str  # where it came from (path, URL or name), as indexed
    title: str  # display title
    num_chunks: int  # chunks stored for it
    num_tokens: int  # generator tokens over its chunks (what its caches hold)
    indexed_at: float  # unix time of its last (re-)index
