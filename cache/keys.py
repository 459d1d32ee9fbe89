"""Storage keys: ``"<namespace>/<digest>"``, validated at every tier's door.

A key names one tenant's entry. Tiers accept nothing else, so a caller cannot reach another
tenant's entries through a crafted key (``"../x"``, a glob, another prefix).

>>> key = "0123456789abcdef/" + "a" * 64
>>> validate_key(key) == key
True
>>> key_namespace(key)
'0123456789abcdef'
>>> validate_namespace("0123456789abcdef")
'0123456789abcdef'
"""

from __future__ import annotations

import re

__all__ = [
    "KEY_PATTERN",
    "NAMESPACE_PATTERN",
    "key_namespace",
    "validate_key",
    "validate_namespace",
    "validate_value",
]

# 16 hex chars of the tenant's digest (ragkv.types.tenant_namespace), "/", a sha256 hex digest.
NAMESPACE_PATTERN = re.compile(r"[0-9a-f]{16}")
KEY_PATTERN = re.compile(r"([0-9a-f]{16})/[0-9a-f]{64}")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a storage key, else raise.

    Raises:
        TypeError: ``key`` is not a str.
        ValueError: ``key`` is not ``"<16 hex namespace>/<64 hex digest>"``.
    """
    if not isinstance(key, str):
        raise TypeError(f"storage keys are str; got {type(key).__name__}")
    if KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(
            f"not a storage key: {key[:100]!r}; use ChunkKey.storage_key "
            "('<16 hex tenant namespace>/<sha256 hex digest>', lowercase)"
        )
    return key


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a tenant namespace (16 lowercase hex chars), else raise.

    Raises:
        TypeError: ``namespace`` is not a str.
        ValueError: it is not a namespace; pass ``ragkv.types.tenant_namespace(tenant)``.
    """
    if not isinstance(namespace, str):
        raise TypeError(f"namespaces are str; got {type(namespace).__name__}")
    if NAMESPACE_PATTERN.fullmatch(namespace) is None:
        raise ValueError(f"not a tenant namespace: {namespace[:100]!r}; use ragkv.types.tenant_namespace(tenant)")
    return namespace


def key_namespace(key: str) -> str:
    """The namespace part of a valid storage key."""
    return validate_key(key)[:16]


def validate_value(value: object) -> bytes:
    """Return ``value`` as ``bytes`` (bytearray and memoryview are copied).

    Raises:
        TypeError: anything else; tiers store bytes, so encode with a ragkv codec first.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"tiers store bytes; got {type(value).__name__} (encode it with a ragkv codec first)")
