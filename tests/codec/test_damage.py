"""Damaged, truncated, foreign and crafted bytes: decode raises CodecError, never anything else."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragkv.codec import FORMAT_VERSION, Expected, available_codecs, decode, read_header
from ragkv.codec.bitstream import MAGIC, pack, unpack
from ragkv.errors import CodecError, IncompatibleCacheError
from ragkv.types import ChunkKV
from tests.codec.conftest import KVFactory, encoded, expected

CODECS = sorted(available_codecs())
SECRET = b"a deployment secret of 32 bytes!"


def _kv(tokens: int) -> ChunkKV:
    gen = torch.Generator().manual_seed(tokens)
    shape = (2, 2, tokens, 8)
    return ChunkKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(tokens), "test")


def _blob(name: str, tokens: int = 9, secret: bytes | None = None) -> bytes:
    return encoded(_kv(tokens), name, available_codecs()[name][-1], secret)


def _expect(name: str, tokens: int = 9, secret: bytes | None = None) -> Expected:
    return expected(_kv(tokens), name, available_codecs()[name][-1], secret)


def _regions(data: bytes) -> dict[str, range]:
    """Byte ranges of the prelude, header, each payload section and the checksum."""
    header, sections = unpack(data)
    start = len(data) - 8 - header.tag_nbytes - header.payload_nbytes
    regions = {"prelude": range(0, 20), "header": range(20, start)}
    for i, size in enumerate(header.section_sizes):
        regions[f"section{i}"] = range(start, start + size)
        start += size
    if header.tag_nbytes:
        regions["tag"] = range(start, start + header.tag_nbytes)
    regions["checksum"] = range(len(data) - 8, len(data))
    return regions


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "signed"])
@pytest.mark.parametrize("name", CODECS)
def test_every_damaged_byte_is_detected(name: str, secret: bytes | None) -> None:
    data = _blob(name, secret=secret)
    regions = _regions(data)
    assert all(len(r) > 0 for r in regions.values()) and len(regions) >= 5 + (secret is not None)
    rng = random.Random(0)
    # a reader with the secret, one without, and a tool without an expectation all refuse it
    expects = [_expect(name, secret=secret), _expect(name), None]
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 1 << rng.randrange(8)
        for expect in expects:
            with pytest.raises(CodecError):
                decode(bytes(damaged), expect=expect)


@pytest.mark.parametrize("name", CODECS)
def test_damage_in_each_region_is_detected_by_read_header_or_decode(name: str) -> None:
    data = _blob(name, tokens=30)
    for region, span in _regions(data).items():
        for i in (span.start, span.stop - 1):
            damaged = bytearray(data)
            damaged[i] ^= 0xFF
            with pytest.raises(CodecError):
                decode(bytes(damaged), expect=_expect(name, tokens=30))
            if region in ("prelude", "header"):
                with pytest.raises(CodecError):
                    read_header(bytes(damaged))


@pytest.mark.parametrize("name", CODECS)
def test_truncation_at_every_length_is_detected(name: str) -> None:
    data = _blob(name)
    for n in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:n], expect=_expect(name))
    with pytest.raises(CodecError):
        decode(data + b"\0", expect=_expect(name))


def test_foreign_bytes_are_refused() -> None:
    for junk in (b"", b"RKV", b"PK\x03\x04" + bytes(100), b"\x80\x04\x95" + bytes(40)):
        with pytest.raises(CodecError, match="truncated|not a ragkv"):
            decode(junk, expect=_expect("raw"))


def test_newer_format_version_is_refused_clearly(make_kv: KVFactory) -> None:
    kv = make_kv()
    header, sections = unpack(encoded(kv, "int8"))
    newer = pack(dataclasses.replace(header, format_version=FORMAT_VERSION + 1), [bytes(s) for s in sections])
    with pytest.raises(IncompatibleCacheError, match="newer ragkv.*upgrade"):
        read_header(newer)
    for expect in (expected(kv, "int8"), None):
        with pytest.raises(IncompatibleCacheError, match="newer ragkv.*upgrade"):
            decode(newer, expect=expect)


def test_unknown_codec_is_a_codec_error(make_kv: KVFactory) -> None:
    header, sections = unpack(encoded(make_kv(), "raw"))
    data = pack(dataclasses.replace(header, codec="from-the-future"), [bytes(s) for s in sections])
    assert read_header(data).codec == "from-the-future"
    with pytest.raises(CodecError, match="from-the-future"):
        decode(data, expect=None)


def test_read_header_is_cheap_and_complete(make_kv: KVFactory) -> None:
    kv = make_kv(4, 2, 37, 16, start=100)
    data = encoded(kv, "cachegen", 2)
    header = read_header(data)
    assert header.shape == (4, 2, 37, 16)
    assert (header.codec, header.level, header.format_version) == ("cachegen", 2, FORMAT_VERSION)
    assert header.source_dtype == "float16" and header.model_fingerprint == "test"
    assert header.positions() == list(range(100, 137)) and header.position_runs == ((100, 37),)
    # Only the prelude and header are read: a payload cut off still gives the header.
    cut = len(data) - header.payload_nbytes - 8
    assert read_header(data[:cut]) == header


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_codec_error(junk: bytes) -> None:
    for data in (junk, MAGIC + junk, MAGIC + b"\x01\x00\x00\x00" + junk, MAGIC + b"\x02\x00\x00\x00" + junk):
        for expect in (None, _expect("raw")):
            with pytest.raises(CodecError):
                decode(data, expect=expect)


_BLOBS = {name: _blob(name, tokens=12) for name in CODECS}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CODECS), st.data())
def test_random_damage_raises_codec_error(name: str, data: st.DataObject) -> None:
    damaged = bytearray(_BLOBS[name])
    size = len(damaged)
    flips = data.draw(st.dictionaries(st.integers(0, size - 1), st.integers(1, 255), min_size=1, max_size=4))
    for where, mask in flips.items():
        damaged[where] ^= mask
    with pytest.raises(CodecError):
        decode(bytes(damaged), expect=_expect(name, tokens=12))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CODECS), st.data())
def test_crafted_payloads_with_valid_checksums_never_crash(name: str, data: st.DataObject) -> None:
    """A hostile writer can make checksums match; the decoder must still fail cleanly, even a tool's
    decode without an expectation (the header's key and shape are right: only the payload lies)."""
    header, sections = unpack(_BLOBS[name])
    new_sections = []
    for section in sections:
        raw = bytearray(section)
        if raw and data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        new_sections.append(bytes(raw))
    params = dict(header.params)
    if params.get("bits") and data.draw(st.booleans()):
        params["bits"] = data.draw(st.lists(st.sampled_from([0, 4, 8, 16, 32]), max_size=len(params["bits"]) + 1))
    crafted = dataclasses.replace(header, section_sizes=tuple(len(s) for s in new_sections), params=params)
    blob = pack(crafted, new_sections)
    try:
        out = decode(blob, expect=None if data.draw(st.booleans()) else _expect(name, tokens=12))
    except CodecError:
        return
    assert out.keys.shape == header.shape  # a surviving decode still has the promised shape
