"""Framing of a ragkv bitstream: magic, version, header, payload sections, checksums.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"RKVC"
    4       2     format version (uint16)
    6       2     reserved, zero
    8       4     header length H (uint32)
    12      8     xxh3-64 of bytes [0, 12) + header
    20      H     header: canonical JSON (see BitstreamHeader)
    20+H    P     payload: the header's sections, concatenated
    20+H+P  8     xxh3-64 of every byte before it

The header has its own checksum so that :func:`read_header` can trust it without touching the
payload; the trailing checksum covers everything, so damage anywhere is detected. xxh3 was
measured at about 30 GB/s here against 1.3 GB/s for zlib.crc32 (and 0.3 GB/s for blake2b): with
crc32 the checksum alone took about a third of a raw decode.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from ragkv.codec.header import BitstreamHeader
from ragkv.errors import CodecError, IncompatibleCacheError

__all__ = ["FORMAT_VERSION", "MAGIC", "pack", "unpack", "read_header"]

MAGIC = b"RKVC"
FORMAT_VERSION = 1

_PRELUDE = struct.Struct("<4sHHIQ")  # magic, version, reserved, header length, header checksum
_DIGEST = struct.Struct("<Q")
_MAX_HEADER = 1 << 24


def _digest(*parts: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


def pack(header: BitstreamHeader, sections: Sequence[bytes]) -> bytes:
    """Frame ``header`` and its payload ``sections`` into one bitstream.

    Raises:
        ValueError: the section lengths differ from ``header.section_sizes``.
    """
    if tuple(len(s) for s in sections) != header.section_sizes:
        raise ValueError("section lengths must match header.section_sizes")
    head = header.to_json_bytes()
    # Trailing spaces (valid JSON whitespace) align the payload to 16 bytes, so that decoders
    # can view tables in place.
    head += b" " * (-(_PRELUDE.size + len(head)) % 16)
    if len(head) > _MAX_HEADER:
        raise ValueError(f"bitstream header is {len(head)} bytes; at most {_MAX_HEADER} fit")
    start = struct.pack("<4sHHI", MAGIC, header.format_version, 0, len(head))
    prelude = start + _DIGEST.pack(_digest(start, head))
    body = b"".join([prelude, head, *sections])
    return body + _DIGEST.pack(_digest(body))


def _parse_prelude(view: memoryview) -> tuple[BitstreamHeader, int]:
    """Validate magic, version and header checksum; return the header and the payload offset."""
    if len(view) < _PRELUDE.size:
        raise CodecError(f"bitstream is truncated: {len(view)} bytes, fewer than its prelude")
    magic, version, reserved, head_len, head_digest = _PRELUDE.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"not a ragkv bitstream (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version > FORMAT_VERSION:
        raise IncompatibleCacheError(
            f"bitstream format version {version} was written by a newer ragkv (this one reads "
            f"version {FORMAT_VERSION} and older); upgrade ragkv, or re-encode the chunk"
        )
    if version < 1 or reserved != 0:
        raise CodecError(f"bitstream prelude is corrupt (version {version}, reserved {reserved})")
    end = _PRELUDE.size + head_len
    if head_len > _MAX_HEADER or end > len(view):
        raise CodecError("bitstream is truncated inside its header")
    head = view[_PRELUDE.size : end]
    if _digest(view[:12], head) != head_digest:
        raise CodecError("bitstream header checksum mismatch: the header is corrupt")
    header = BitstreamHeader.from_json_bytes(bytes(head))
    if header.format_version != version:
        raise CodecError("bitstream header disagrees with its prelude about the format version")
    return header, end


def read_header(data: bytes | bytearray | memoryview) -> BitstreamHeader:
    """Read and check a bitstream's header without reading its payload.

    Raises:
        IncompatibleCacheError: the bitstream was written by a newer format version.
        CodecError: the bytes are not a ragkv bitstream, or its header is damaged.
    """
    header, _ = _parse_prelude(memoryview(data).cast("B"))
    return header


def unpack(data: bytes | bytearray | memoryview) -> tuple[BitstreamHeader, list[memoryview]]:
    """Check a whole bitstream and split it into its header and payload sections.

    Returns:
        The header and one read-only view per payload section (views into ``data``, no copy).

    Raises:
        IncompatibleCacheError: the bitstream was written by a newer format version.
        CodecError: the bytes are truncated, corrupted or not a ragkv bitstream.
    """
    view = memoryview(data).cast("B").toreadonly()
    header, offset = _parse_prelude(view)
    end = offset + header.payload_nbytes
    if len(view) != end + _DIGEST.size:
        raise CodecError(
            f"bitstream length {len(view)} does not match its header ({end + _DIGEST.size} bytes): truncated or padded"
        )
    (expected,) = _DIGEST.unpack_from(view, end)
    if _digest(view[:end]) != expected:
        raise CodecError("bitstream checksum mismatch: the payload is corrupt")
    sections = []
    for size in header.section_sizes:
        sections.append(view[offset : offset + size])
        offset += size
    return header, sections
