"""``EntryRecord``: one stored chunk cache, as the catalog records it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EntryRecord"]


@dataclass(frozen=True, slots=True)
class EntryRecord:
    """A KV entry in the store: what it is and how it has been used."""

    storage_key: str  # "<namespace>/<digest>" (ChunkKey.storage_key)
    tenant: str  # owner
    tokens_digest: str  # digest of the chunk's token ids (ChunkKey.tokens_digest)
    codec: str  # codec name in the registry
    level: int  # codec quality level
    nbytes: int  # encoded size in bytes
    num_tokens: int  # tokens in the chunk
    hits: int  # reads recorded by touch_entries
    created_at: float  # unix seconds when first recorded
    last_access: float  # unix seconds of the last record or touch
