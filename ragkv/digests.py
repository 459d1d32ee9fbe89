"""Canonical digests. sha256 over a canonical byte encoding; never Python's ``hash()``.

>>> tokens_digest([1, 2, 3]) == tokens_digest((1, 2, 3))
True
>>> len(sha256_hex(b"abc"))
64
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NewType

Digest = NewType("Digest", str)
"""A lowercase hex sha256 digest (64 characters)."""


def sha256_hex(data: bytes) -> Digest:
    """Return the hex sha256 of ``data``."""
    return Digest(hashlib.sha256(data).hexdigest())


def tokens_digest(token_ids: Sequence[int]) -> Digest:
    """Digest of a token id sequence (little-endian uint32 each, length-prefixed)."""
    ids = list(token_ids)
    if any(t < 0 or t >= 2**32 for t in ids):
        raise ValueError("token ids must be in [0, 2**32)")
    return sha256_hex(struct.pack(f"<Q{len(ids)}I", len(ids), *ids))


def text_digest(text: str) -> Digest:
    """Digest of a text (UTF-8)."""
    return sha256_hex(text.encode("utf-8"))


def fields_digest(fields: Iterable[tuple[str, str | int]]) -> Digest:
    """Digest of named fields, each encoded as length-prefixed name and value.

    Length prefixes make the encoding unambiguous: ``("a", "bc")`` and ``("ab", "c")`` differ.
    """
    h = hashlib.sha256()
    for name, value in fields:
        for part in (name, f"{type(value).__name__}:{value}"):
            b = part.encode("utf-8")
            h.update(struct.pack("<I", len(b)))
            h.update(b)
    return Digest(h.hexdigest())
