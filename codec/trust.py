"""What a bitstream must be for a reader to use it: the expectation, and the authentication tag.

Two defences, for two threats:

- Identity. Every bitstream names the storage key it was written for (tenant namespace, model,
  tokenizer, prefix, tokens, codec, level and format are all digested into it), and a reader
  compares that, the model fingerprint, the codec, level and every shape field with what it
  asked for, before it hashes or allocates anything for the payload. A blob swapped with another
  chunk's, copied from another tenant or stored under another codec's key is refused; so is a
  header that claims a tensor larger than the chunk it stands for (a decode memory bomb).
- Authenticity, for shared tiers whose writers are not all trusted. A checksum only detects
  damage, and a storage key is a digest of things a writer can compute, so anyone who can write
  to the tier can forge a blob with a correct header. With a secret, the writer appends an
  HMAC-SHA256 tag over every byte, keyed per tenant namespace; a reader that holds the secret
  refuses a blob without a valid tag. docs/deployment.md spells out the resulting trust model.

>>> mac_key(b"s3cret", "0123456789abcdef/00") == mac_key(b"s3cret", "0123456789abcdef/ff")
True
>>> mac_key(b"s3cret", "0123456789abcdef/00") == mac_key(b"s3cret", "fedcba9876543210/00")
False
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragkv.errors import IncompatibleCacheError
from ragkv.types import ChunkKV, CodecSpec, ModelFingerprint, StorageKey

if TYPE_CHECKING:
    from ragkv.codec.header import BitstreamHeader

__all__ = ["Expected", "TAG_NBYTES", "check_expected", "compute_tag", "mac_key", "key_namespace"]

TAG_NBYTES = 32  # HMAC-SHA256


@dataclass(frozen=True, slots=True)
class Expected:
    """What the caller asked for: a bitstream that is anything else is refused before decoding.

    The query path builds one from the chunk's key and the loaded model, so every field is known
    without trusting the stored bytes. Shapes are those of the chunk's KV, ``[layers, kv_heads,
    tokens, head_dim]``.
    """

    key: StorageKey  # the storage key the blob was read from
    model_fingerprint: ModelFingerprint  # the model that will use the KV
    spec: CodecSpec  # codec and level the key was computed for
    num_layers: int  # the model's decoder layers
    num_kv_heads: int  # the model's key/value heads
    head_dim: int  # the model's per-head dimension
    num_tokens: int  # the chunk's real token count
    # When set, the blob must carry a valid tag made with this secret (see mac_key). repr=False:
    # an Expected may end up in a log line; the secret must not.
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        key_namespace(self.key)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("num_tokens", self.num_tokens, minimum=0)
        check_secret(self.secret)

    @classmethod
    def of(cls, kv: ChunkKV, spec: CodecSpec, key: StorageKey, secret: bytes | None = None) -> Expected:
        """What a reader who knows ``kv`` expects: for tools and tests that decode bytes they encoded.

        The query path builds its expectation from the loaded model and the chunk instead.
        """
        return cls(
            key=key,
            model_fingerprint=ModelFingerprint(kv.model_fingerprint),
            spec=spec,
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            num_tokens=kv.num_tokens,
            secret=secret,
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(layers, kv_heads, tokens, head_dim)`` of keys (and of values)."""
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Expected.{name} must be an int >= {minimum}; got {value!r}")


def check_secret(secret: object) -> None:
    """Raise unless ``secret`` is None or non-empty bytes.

    Raises:
        TypeError: ``secret`` is not bytes (e.g. a str: encode it, ``secret.encode()``).
        ValueError: ``secret`` is empty.
    """
    if secret is None:
        return
    if not isinstance(secret, bytes):
        raise TypeError(f"a store secret must be bytes (e.g. secret.encode()); got {type(secret).__name__}")
    if not secret:
        raise ValueError("a store secret must not be empty; leave it None to store without authentication")


def key_namespace(key: str) -> str:
    """The tenant namespace of a storage key ``<namespace>/<digest>``.

    Raises:
        ValueError: ``key`` is not of that form (use ``ChunkKey.storage_key``).
    """
    namespace, sep, rest = key.partition("/") if isinstance(key, str) else ("", "", "")
    if not (namespace and sep and rest):
        raise ValueError(f"a storage key is '<namespace>/<digest>' (use ChunkKey.storage_key); got {key!r}")
    return namespace


def mac_key(secret: bytes, key: str) -> bytes:
    """The tag key of ``key``'s tenant namespace: HMAC-SHA256(secret, "ragkv-mac:" + namespace).

    One key per namespace: a tag made for one tenant does not pass for another, even when a
    deployment gives every tenant the same secret.
    """
    check_secret(secret)
    return hmac.new(secret, b"ragkv-mac:" + key_namespace(key).encode("utf-8"), hashlib.sha256).digest()


def compute_tag(mac_key: bytes, data: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``data`` under ``mac_key`` (``TAG_NBYTES`` bytes)."""
    return hmac.new(mac_key, data, hashlib.sha256).digest()


def check_expected(header: BitstreamHeader, expect: Expected) -> None:
    """Refuse a header that is not for what ``expect`` asks for.

    Raises:
        IncompatibleCacheError: the header names another key, model, codec, level or shape.
    """
    if header.storage_key != expect.key:
        raise IncompatibleCacheError(
            f"bitstream was written for key {header.storage_key or '(none: format 1)'!r}, not for "
            f"{expect.key!r}: a moved, swapped or foreign entry; recompute it"
        )
    if header.model_fingerprint != expect.model_fingerprint:
        raise IncompatibleCacheError(
            f"cached KV was computed by model {header.model_fingerprint!r}, not by "
            f"{expect.model_fingerprint!r}; recompute it for this model"
        )
    if (header.codec, header.level) != (expect.spec.name, expect.spec.level):
        raise IncompatibleCacheError(
            f"bitstream is {header.codec}:{header.level}, not the {expect.spec} asked for; recompute it"
        )
    if header.shape != expect.shape:
        raise IncompatibleCacheError(
            f"bitstream holds KV of shape {header.shape} [layers, kv_heads, tokens, head_dim], but this model "
            f"and chunk need {expect.shape}; recompute it"
        )
