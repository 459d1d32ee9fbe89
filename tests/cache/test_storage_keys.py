"""Storage keys and values at the tier boundary."""

from __future__ import annotations

import pytest

from ragkv.cache.keys import key_namespace, validate_key, validate_namespace, validate_value
from ragkv.digests import fields_digest, sha256_hex
from ragkv.types import ChunkKey, CodecSpec, ModelFingerprint, TokenizerFingerprint, tenant_namespace


def _key(**kw: object) -> ChunkKey:
    fields: dict = dict(
        model_fingerprint=ModelFingerprint("model"),
        tokenizer_fingerprint=TokenizerFingerprint("tok"),
        prefix_digest=sha256_hex(b"p"),
        tokens_digest=sha256_hex(b"t"),
        codec=CodecSpec("raw", 0),
        format_version=1,
        tenant="acme",
    )
    return ChunkKey(**(fields | kw))


def test_chunk_keys_are_valid_storage_keys() -> None:
    key = _key()
    assert validate_key(key.storage_key) == key.storage_key
    assert key_namespace(key.storage_key) == tenant_namespace("acme")


def test_chunk_key_digest_hashes_codec_and_level_as_named_fields() -> None:
    """CodecSpec is one record in the key, but the digest formula is the one of separate fields."""
    expected = fields_digest(
        [
            ("model", "model"),
            ("tokenizer", "tok"),
            ("prefix", sha256_hex(b"p")),
            ("tokens", sha256_hex(b"t")),
            ("codec", "raw"),
            ("level", 0),
            ("format", 1),
            ("tenant", "acme"),
        ]
    )
    assert _key().digest == expected
    digests = {_key().digest, _key(codec=CodecSpec("raw", 1)).digest, _key(codec=CodecSpec("int8", 0)).digest}
    assert len(digests) == 3 and _key(format_version=2).digest != expected


@pytest.mark.parametrize("bad", [None, 1, b"0123456789abcdef/" + b"a" * 64])
def test_non_strings_are_type_errors(bad: object) -> None:
    with pytest.raises(TypeError):
        validate_key(bad)


@pytest.mark.parametrize("bad", ["", "ABCDEF0123456789", "0123456789abcde", "0123456789abcdef/", "../x"])
def test_bad_namespaces(bad: str) -> None:
    with pytest.raises(ValueError, match="tenant_namespace"):
        validate_namespace(bad)


def test_values() -> None:
    assert validate_value(memoryview(b"ab")) == b"ab"
    with pytest.raises(TypeError, match="codec"):
        validate_value([1, 2])
