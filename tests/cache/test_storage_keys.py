"""Storage keys and values at the tier boundary."""

from __future__ import annotations

import pytest

from ragkv.cache.keys import key_namespace, validate_key, validate_namespace, validate_value
from ragkv.digests import sha256_hex
from ragkv.types import ChunkKey, tenant_namespace


def test_chunk_keys_are_valid_storage_keys() -> None:
    key = ChunkKey("model", "tok", sha256_hex(b"p"), sha256_hex(b"t"), "raw", 0, 1, tenant="acme")
    assert validate_key(key.storage_key) == key.storage_key
    assert key_namespace(key.storage_key) == tenant_namespace("acme")


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
