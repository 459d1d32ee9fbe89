"""Identity and authenticity: a blob decodes only as what the reader asked for, and a signed store
accepts only what the secret's holders wrote."""

from __future__ import annotations

import dataclasses
import doctest
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash

import ragkv.codec
import ragkv.codec.trust
from ragkv.codec import Expected, available_codecs, decode, encode, read_header
from ragkv.codec.bitstream import pack, unpack
from ragkv.codec.trust import mac_key
from ragkv.digests import sha256_hex
from ragkv.errors import CodecError, IncompatibleCacheError
from ragkv.types import CodecSpec, StorageKey, tenant_namespace
from tests.codec.conftest import KEY, KVFactory, encoded, expected

CODECS = [(name, levels[-1]) for name, levels in sorted(available_codecs().items())]
SECRET = b"a deployment secret of 32 bytes!"
OTHER_TENANT_KEY = StorageKey(f"{tenant_namespace('someone-else')}/{KEY.split('/')[1]}")
OTHER_CHUNK_KEY = StorageKey(f"{KEY.split('/')[0]}/{sha256_hex(b'another chunk')}")


MISMATCHES: dict[str, Callable[[Expected], dict[str, Any]]] = {
    "key of another chunk": lambda e: {"key": OTHER_CHUNK_KEY},
    "key of another tenant": lambda e: {"key": OTHER_TENANT_KEY},
    "model": lambda e: {"model_fingerprint": "other-model"},
    "codec": lambda e: {"spec": CodecSpec("int8" if e.spec.name != "int8" else "raw", 0)},
    "level": lambda e: {"spec": CodecSpec(e.spec.name, e.spec.level + 1)},
    "layers": lambda e: {"num_layers": e.num_layers + 1},
    "heads": lambda e: {"num_kv_heads": e.num_kv_heads - 1},
    "head_dim": lambda e: {"head_dim": e.head_dim * 2},
    "tokens": lambda e: {"num_tokens": e.num_tokens - 1},
}


@pytest.mark.parametrize("field", sorted(MISMATCHES))
@pytest.mark.parametrize(("name", "level"), CODECS)
def test_every_field_of_the_expectation_must_match(make_kv: KVFactory, name: str, level: int, field: str) -> None:
    kv = make_kv(3, 2, 21, 8)
    data = encoded(kv, name, level)
    expect = expected(kv, name, level)
    assert torch.equal(decode(data, expect=expect).positions, kv.positions)
    with pytest.raises(IncompatibleCacheError, match="recompute"):
        decode(data, expect=dataclasses.replace(expect, **MISMATCHES[field](expect)))


def test_swapped_blobs_of_same_length_chunks_are_refused(make_kv: KVFactory) -> None:
    a, b = make_kv(2, 2, 30, 8), make_kv(2, 2, 30, 8)
    spec = CodecSpec("cachegen", 0)
    blob_a = encode(a, spec, key=KEY).data
    blob_b = encode(b, spec, key=OTHER_CHUNK_KEY).data
    # the swap the issue describes: each decodes fine on its own, but under the other's key...
    assert decode(blob_a, expect=Expected.of(a, spec, KEY)).num_tokens == 30
    with pytest.raises(IncompatibleCacheError, match="moved, swapped or foreign"):
        decode(blob_b, expect=Expected.of(a, spec, KEY))
    with pytest.raises(IncompatibleCacheError, match="moved, swapped or foreign"):
        decode(blob_a, expect=Expected.of(b, spec, OTHER_CHUNK_KEY))


def test_format_1_blobs_still_parse_but_never_match(make_kv: KVFactory) -> None:
    kv = make_kv()
    header, sections = unpack(encoded(kv, "raw"))
    old = pack(dataclasses.replace(header, format_version=1, storage_key=""), [bytes(s) for s in sections])
    assert read_header(old).format_version == 1 and read_header(old).storage_key == ""
    with pytest.raises(IncompatibleCacheError, match="format 1"):
        decode(old, expect=expected(kv, "raw"))
    assert torch.equal(decode(old, expect=None, dtype=torch.float16).keys, kv.keys)  # tools can still read it


def test_a_format_2_header_must_name_its_key(make_kv: KVFactory) -> None:
    header, sections = unpack(encoded(make_kv(), "raw"))
    keyless = pack(dataclasses.replace(header, storage_key=""), [bytes(s) for s in sections])
    with pytest.raises(CodecError, match="storage key"):
        read_header(keyless)


# ---- authentication ------------------------------------------------------------------------------


def _forge(data: bytes, sign_with: bytes | None, **changes: object) -> bytes:
    """Rebuild a bitstream with header ``changes``, as a writer holding ``sign_with`` (or no key) could."""
    header, sections = unpack(data)
    header = dataclasses.replace(header, **changes)  # type: ignore[arg-type]
    return pack(header, [bytes(s) for s in sections], mac_key=sign_with)


@pytest.mark.parametrize(("name", "level"), CODECS)
def test_signed_blobs_pass_with_the_secret(make_kv: KVFactory, name: str, level: int) -> None:
    kv = make_kv(2, 2, 13, 8)
    signed = encoded(kv, name, level, secret=SECRET)
    assert read_header(signed).auth == "hmac-sha256"
    out = decode(signed, expect=expected(kv, name, level, secret=SECRET))
    ref = decode(encoded(kv, name, level), expect=expected(kv, name, level))
    assert torch.equal(out.keys, ref.keys) and torch.equal(out.values, ref.values)
    # a reader without the secret trusts its store anyway: the tag is extra bytes to it
    assert torch.equal(decode(signed, expect=expected(kv, name, level)).keys, ref.keys)


FORGERIES = {
    "unsigned": lambda kv, signed: encoded(kv, "cachegen", 0),
    "signed with another secret": lambda kv, signed: encoded(kv, "cachegen", 0, secret=b"not the deployment's"),
    # a writer without the secret strips the tag and the auth flag, and fixes the checksums
    "tag stripped": lambda kv, signed: _forge(signed, None, auth=""),
    # ... or re-signs the blob with a key of its own
    "re-signed": lambda kv, signed: _forge(signed, hashlib.sha256(b"attacker").digest()),
    # the right secret, but the tag key of another tenant's namespace
    "another namespace's tag": lambda kv, signed: _forge(signed, mac_key(SECRET, OTHER_TENANT_KEY)),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_blobs_not_signed_with_the_secret_fail(make_kv: KVFactory, forgery: str) -> None:
    kv = make_kv(2, 2, 13, 8)
    signed = encoded(kv, "cachegen", 0, secret=SECRET)
    data = FORGERIES[forgery](kv, signed)
    assert decode(data, expect=expected(kv, "cachegen", 0)).num_tokens == 13  # a fine blob, but not signed by us
    with pytest.raises(CodecError, match="no tag|tag mismatch"):
        decode(data, expect=expected(kv, "cachegen", 0, secret=SECRET))


def test_a_signed_payload_cannot_be_altered_even_with_valid_checksums(make_kv: KVFactory) -> None:
    kv = make_kv(2, 2, 13, 8, dtype=torch.float32)
    signed = encoded(kv, "raw", secret=SECRET)
    tag_start = len(signed) - 8 - read_header(signed).tag_nbytes
    body = bytearray(signed[:tag_start])
    body[-3] ^= 0x40  # change one value, keep the old tag, recompute the trailing checksum
    tampered = bytes(body) + signed[tag_start:-8]
    tampered += xxhash.xxh3_64_intdigest(tampered).to_bytes(8, "little")
    assert decode(tampered, expect=expected(kv, "raw")).num_tokens == 13  # intact to every checksum
    with pytest.raises(CodecError, match="tag mismatch"):
        decode(tampered, expect=expected(kv, "raw", secret=SECRET))


def test_secrets_are_checked_and_never_shown(make_kv: KVFactory) -> None:
    kv = make_kv()
    with pytest.raises(TypeError, match="bytes"):
        encoded(kv, secret="a str secret")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        expected(kv, secret=b"")
    assert SECRET.decode() not in repr(expected(kv, secret=SECRET))
    assert mac_key(SECRET, KEY) == hmac.new(SECRET, b"ragkv-mac:" + KEY.split("/")[0].encode(), hashlib.sha256).digest()


@pytest.mark.parametrize("module", [ragkv.codec, ragkv.codec.trust])
def test_doctests(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0
