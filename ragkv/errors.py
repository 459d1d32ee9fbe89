"""The errors ragkv raises. Callers act on the few classes here; bad arguments raise ValueError/TypeError."""

from __future__ import annotations

__all__ = [
    "DocumentNotFoundError",
    "RagkvError",
    "CodecError",
    "StoreUnavailableError",
    "IncompatibleCacheError",
    "UnsupportedModelError",
    "CatalogError",
    "ContextTooLongError",
    "StorageWriteError",
]


class RagkvError(Exception):
    """Root of every error ragkv raises on purpose."""


class CodecError(RagkvError):
    """Bytes that are not a valid, intact ragkv bitstream: truncated, corrupted, foreign, unauthenticated, too new."""


class IncompatibleCacheError(CodecError):
    """An intact bitstream made for something else than the caller asked for.

    Another storage key (a moved or swapped entry), model, codec, level or shape, or a newer
    format version.
    """


class StoreUnavailableError(RagkvError):
    """A storage tier cannot be reached (down, timed out, refused)."""


class CatalogError(RagkvError):
    """The catalog database is unreachable or its schema does not match this version of ragkv."""


class UnsupportedModelError(RagkvError):
    """The model's architecture lacks something ragkv needs (the message names what)."""


class ContextTooLongError(RagkvError, ValueError):
    """A prompt does not fit in the model's context window."""


class DocumentNotFoundError(RagkvError, LookupError):
    """No document with that source in the tenant's catalog."""


class StorageWriteError(RagkvError, OSError):
    """A file ragkv must write (the FAISS index) could not be written (a full disk, no permission);
    what was being committed was not.

    An ``OSError`` too, with the ``errno`` of the failure (e.g. ENOSPC), for callers that handle those."""
