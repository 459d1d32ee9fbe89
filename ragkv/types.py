"""The few frozen records that cross module boundaries.

This module imports no torch at run time, so ``ragkv.cache`` (which never imports torch) can use
its key records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NewType

from ragkv.digests import Digest, fields_digest, sha256_hex

if TYPE_CHECKING:
    import torch

__all__ = [
    "ChunkKV",
    "ChunkKey",
    "CodecSpec",
    "DEFAULT_CODEC",
    "EncodedChunk",
    "ModelFingerprint",
    "StorageKey",
    "TokenizerFingerprint",
    "Chunk",
    "GenerationStats",
    "GenerationResult",
    "DEFAULT_TENANT",
    "MAX_TENANT_LENGTH",
    "validate_tenant",
    "CachedText",
    "LogitsWanted",
]

DEFAULT_TENANT = "default"

StorageKey = NewType("StorageKey", str)
"""``<namespace>/<digest>``: what tiers store a chunk's bytes under (see ``ChunkKey.storage_key``)."""
ModelFingerprint = NewType("ModelFingerprint", str)
"""``ModelAdapter.fingerprint``: digest of a generator's architecture and weights."""
TokenizerFingerprint = NewType("TokenizerFingerprint", str)
"""``ModelAdapter.tokenizer_fingerprint``: digest of a vocabulary and its special tokens."""
LogitsWanted = Literal["all", "last", "none"]
"""Where a forward pass computes logits: every position, the last one, or none (see ``ModelAdapter.forward``)."""


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A codec and one of its quality levels: how a chunk's KV is (or is to be) encoded.

    >>> CodecSpec("cachegen", 2)
    CodecSpec(name='cachegen', level=2)
    >>> str(DEFAULT_CODEC)
    'cachegen:0'
    """

    name: str  # codec name in the registry, e.g. "cachegen"
    level: int  # codec quality level; lowest = most faithful

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"codec name must be a non-empty str, e.g. 'cachegen'; got {self.name!r}")
        # bool is an int subclass; a level is never a flag.
        if not isinstance(self.level, int) or isinstance(self.level, bool) or self.level < 0:
            raise ValueError(f"codec level must be an int >= 0; got {self.level!r}")

    def __str__(self) -> str:
        return f"{self.name}:{self.level}"


DEFAULT_CODEC = CodecSpec("cachegen", 0)  # 3.7x smaller than fp16 at KL 0.0015 (docs/benchmarks.md)


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """One chunk's KV cache, as the model produced it.

    Keys are stored after RoPE, rotated at ``positions``; moving the chunk elsewhere is
    ``ModelAdapter.rerotate``'s job.
    """

    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], post-RoPE
    values: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    positions: torch.Tensor  # [tokens] int64: the positions the keys were rotated at
    model_fingerprint: str  # ModelAdapter.fingerprint of the model that computed it

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                "ChunkKV keys and values must both be [layers, kv_heads, tokens, head_dim]; got "
                f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.positions.dim() != 1 or self.positions.shape[0] != self.keys.shape[2]:
            raise ValueError(
                f"ChunkKV positions must be [tokens={self.keys.shape[2]}]; got {tuple(self.positions.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    def slice(self, start: int, end: int) -> ChunkKV:
        """Tokens ``start:end`` of this chunk (views, no copy)."""
        return ChunkKV(
            keys=self.keys[:, :, start:end],
            values=self.values[:, :, start:end],
            positions=self.positions[start:end],
            model_fingerprint=self.model_fingerprint,
        )

    def to(self, device: Any = None, dtype: Any = None) -> ChunkKV:
        """Return a copy on ``device`` / in ``dtype`` (positions stay int64)."""
        return ChunkKV(
            keys=self.keys.to(device=device, dtype=dtype),
            values=self.values.to(device=device, dtype=dtype),
            positions=self.positions.to(device=device),
            model_fingerprint=self.model_fingerprint,
        )


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Everything that decides whether a stored chunk cache can be reused.

    ``digest`` is sha256 over all fields, tenant included, so entries of different tenants,
    models, prefixes or codecs never collide.
    """

    model_fingerprint: ModelFingerprint  # weights + architecture of the generator
    tokenizer_fingerprint: TokenizerFingerprint  # vocabulary and special tokens
    prefix_digest: Digest  # tokens of the shared prefix the chunk was computed after
    tokens_digest: Digest  # the chunk's own token ids
    codec: CodecSpec  # codec and level the bytes are encoded with
    format_version: int  # bitstream format version
    tenant: str = DEFAULT_TENANT  # namespace; tenants never see each other's entries
    # digest of the model's channel transform the bytes are coded in ("": none). Digested only when
    # set, so keys without a transform are the ones earlier versions computed.
    transform_digest: str = ""

    @property
    def digest(self) -> Digest:
        fields: list[tuple[str, str | int]] = [
            ("model", self.model_fingerprint),
            ("tokenizer", self.tokenizer_fingerprint),
            ("prefix", self.prefix_digest),
            ("tokens", self.tokens_digest),
            ("codec", self.codec.name),
            ("level", self.codec.level),
            ("format", self.format_version),
            ("tenant", self.tenant),
        ]
        if self.transform_digest:
            fields.append(("transform", self.transform_digest))
        return fields_digest(fields)

    @property
    def namespace(self) -> str:
        """A short digest of the tenant, used as the storage key's prefix."""
        return tenant_namespace(self.tenant)

    @property
    def storage_key(self) -> StorageKey:
        """``<namespace>/<digest>``: what tiers store the bytes under, and what the bytes name as theirs."""
        return StorageKey(f"{self.namespace}/{self.digest}")


MAX_TENANT_LENGTH = 256


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a usable tenant name, else raise (the same limits on every backend).

    >>> validate_tenant("team-a")
    'team-a'

    Raises:
        TypeError: ``tenant`` is not a str.
        ValueError: it is empty, longer than 256 characters, or holds control characters.
    """
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str; got {type(tenant).__name__}")
    if not tenant.strip():
        raise ValueError("tenant must be a non-empty name, e.g. --tenant team-a")
    if len(tenant) > MAX_TENANT_LENGTH:
        raise ValueError(f"tenant name is {len(tenant)} characters; at most {MAX_TENANT_LENGTH} are allowed")
    if not tenant.isprintable():
        raise ValueError("tenant name holds control characters; use printable text")
    return tenant


def tenant_namespace(tenant: str) -> str:
    """The storage-key prefix of ``tenant`` (16 hex chars of its digest)."""
    if not tenant:
        raise ValueError("tenant must be a non-empty string")
    return sha256_hex(b"ragkv-tenant:" + tenant.encode("utf-8"))[:16]


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """A chunk's KV as bytes: ``data`` is one complete, self-describing bitstream."""

    spec: CodecSpec  # codec and level it was encoded with
    num_tokens: int  # tokens in the chunk
    data: bytes  # magic, version, header, payload, checksum

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a document, as retrieved and as stored in the catalog."""

    chunk_id: Digest  # digest of (doc_id, ordinal, text)
    doc_id: Digest  # digest of the document's source and content
    ordinal: int  # index of the chunk in its document
    text: str  # exact text of the chunk
    token_ids: tuple[int, ...]  # the generator's tokens for ``text``, tokenized on its own
    source: str = ""  # where the document came from (path or name)
    score: float | None = None  # retrieval similarity, when retrieved


@dataclass(slots=True)
class GenerationStats:
    """What one answer cost and what it reused."""

    ttft_ms: float = 0.0  # question in to first token out
    prompt_tokens: int = 0  # tokens in the whole prompt (prefix + chunks + suffix)
    reused_tokens: int = 0  # chunk tokens whose cached KV was used as loaded
    recomputed_tokens: int = 0  # chunk tokens recomputed by selective fusion
    prefilled_chunk_tokens: int = 0  # chunk tokens prefilled because no cache existed
    bytes_loaded: int = 0  # encoded bytes read from the store
    generated_tokens: int = 0  # answer tokens
    total_ms: float = 0.0  # question in to last token out
    cache_hits: int = 0  # chunks found in the store
    cache_misses: int = 0  # chunks computed at query time
    fusion: str = "naive"  # how chunk caches were fused
    dtype: str = ""  # the weights' dtype the answer was computed in ("bfloat16", "float32", ...)
    dtype_reason: str = ""  # why that dtype ("asked for", "auto: this CPU has native bf16 matmuls", ...)
    decode_weights: str = "model"  # weights the decode steps read: "model", or "int8"/"int4" (lossy; EngineConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {
            "ttft_ms": round(self.ttft_ms, 2),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "prefilled_chunk_tokens": self.prefilled_chunk_tokens,
            "bytes_loaded": self.bytes_loaded,
            "generated_tokens": self.generated_tokens,
            "total_ms": round(self.total_ms, 2),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "fusion": self.fusion,
            "dtype": self.dtype,
            "dtype_reason": self.dtype_reason,
            "decode_weights": self.decode_weights,
        }
        d.update(self.extra)
        return d


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """An answer and its stats."""

    text: str
    stats: GenerationStats
    sources: tuple[Chunk, ...] = ()  # the retrieved chunks the answer drew on, best first


@dataclass(frozen=True, slots=True)
class CachedText:
    """A prompt segment whose KV cache is stored (or computed once and stored) by ragkv."""

    text: str
