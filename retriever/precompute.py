"""Chunk precompute for indexing: prefill a chunk after the shared prefix, encode it, store the bytes.

This is the part of indexing that scales out: it needs the model and the store, never the catalog
or the FAISS index, and returns small records (keys and sizes) that the indexing driver commits.
The single-process path and the Ray actors (:mod:`ragkv.retriever.ray_index`) both run it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragkv import codec
from ragkv.cache.store import TieredStore
from ragkv.codec.saliency import normalized_attention
from ragkv.digests import tokens_digest
from ragkv.model import AttentionProbe, ModelAdapter
from ragkv.model.threads import adapt_threads
from ragkv.retriever.transforms import TransformConfig, TransformSource

if TYPE_CHECKING:
    from ragkv.cache.catalog import Catalog

from ragkv.types import ChunkKey, ChunkKV, CodecSpec, ModelFingerprint, TokenizerFingerprint, validate_tenant

logger = logging.getLogger(__name__)

__all__ = ["ChunkComputer", "ChunkResult", "ComputeFn", "StoredEntry"]


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One encoded cache some tier accepted: what the catalog records about it."""

    storage_key: str
    tokens_digest: str
    codec: str
    level: int
    nbytes: int  # encoded bytes
    num_tokens: int  # chunk tokens the cache covers


def record_stored(catalog: Catalog, entry: StoredEntry, *, tenant: str, unless_removed: bool = False) -> bool:
    """Record a stored cache in the catalog (after its bytes are in the store): indexing and the
    query path's recomputed misses both do; the query path passes ``unless_removed`` (see
    ``Catalog.record_entry``). Returns whether it is recorded."""
    return catalog.record_entry(
        entry.storage_key,
        tenant=tenant,
        tokens_digest=entry.tokens_digest,
        codec=entry.codec,
        level=entry.level,
        nbytes=entry.nbytes,
        num_tokens=entry.num_tokens,
        unless_removed=unless_removed,
    )


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What precomputing one chunk did."""

    computed: bool  # prefilled by this call (False: every codec's cache was already stored)
    entries: tuple[StoredEntry, ...] = ()  # caches written by this call
    stored: bool = True  # every stored codec's cache is now in some tier
    error: str | None = None  # why the chunk failed (an exception, after any retries); None = no error

    @property
    def ok(self) -> bool:
        return self.stored and self.error is None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


# Runs ``ChunkComputer.ensure_stored`` over chunks' token ids; yields (position, result) as each
# finishes, in any order. The default runs them in this process, in order.
ComputeFn = Callable[[Sequence[tuple[int, ...]]], Iterator[tuple[int, ChunkResult]]]


class ChunkComputer:
    """Prefills, encodes and stores chunk caches for one model, shared prefix, codec set and tenant.

    Args:
        adapter: the model.
        store: where encoded caches go.
        prefix_ids: the shared prefix every chunk is prefilled after.
        codecs: every (codec, level) a chunk is stored at.
        tenant: namespace of the storage keys.
        store_secret: MAC key material for stored entries (None: unauthenticated).
        transform: which codecs are coded in the model's channel transform (default: off, so a
            computer built without it writes the keys and bytes it always did).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        store: TieredStore,
        prefix_ids: Sequence[int],
        codecs: Sequence[CodecSpec],
        *,
        tenant: str,
        store_secret: bytes | None = None,
        transform: TransformConfig | None = None,
    ) -> None:
        if not codecs:
            raise ValueError("codecs is empty; pass at least one CodecSpec to store chunks at")
        self.adapter, self.store = adapter, store
        self.prefix_ids = tuple(prefix_ids)
        self.codecs = tuple(codecs)
        self.tenant = validate_tenant(tenant)
        self.store_secret = store_secret
        self._prefix_kv: ChunkKV | None = None
        self.transform_config = transform or TransformConfig(levels=())
        self.transforms = TransformSource(
            adapter, store, tenant=self.tenant, config=self.transform_config, store_secret=store_secret
        )

    def uses_transform(self) -> bool:
        """Whether any stored codec is coded in the channel transform."""
        return any(self.transform_config.applies(spec) for spec in self.codecs)

    def ensure_transform(self, segments: Sequence[Sequence[int]]) -> None:
        """Make the channel transform available before keys are made, if a stored codec uses it:
        read from the store, or calibrated from ``segments`` (chunk token ids) and stored."""
        if self.uses_transform() and any(len(s) >= 2 for s in segments):
            try:
                self.transforms.ensure(self.prefix_kv(), segments)
            except (ValueError, RuntimeError) as e:  # keys then miss and chunks are stored uncoded in one
                logger.warning("could not calibrate the channel transform (%s); chunks are coded without it", e)

    def prefix_kv(self) -> ChunkKV:
        """The exact KV of the shared prefix (computed once per process)."""
        if self._prefix_kv is None:
            self._prefix_kv = self.adapter.prefill_kv(list(self.prefix_ids))
        return self._prefix_kv

    def chunk_key(self, token_ids: Sequence[int], spec: CodecSpec) -> ChunkKey:
        """The key of the chunk ``token_ids`` encoded with ``spec``, for this model, prefix and tenant."""
        return ChunkKey(
            model_fingerprint=ModelFingerprint(self.adapter.fingerprint),
            tokenizer_fingerprint=TokenizerFingerprint(self.adapter.tokenizer_fingerprint),
            prefix_digest=tokens_digest(self.prefix_ids),
            tokens_digest=tokens_digest(token_ids),
            codec=spec,
            format_version=codec.FORMAT_VERSION,
            tenant=self.tenant,
            transform_digest=self.transforms.digest() if self.transform_config.applies(spec) else "",
        )

    def missing(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        """The keys of the chunk's caches that no lasting tier holds (a copy only in this process's
        memory tier is missing: it ends with the process)."""
        keys = [self.chunk_key(token_ids, spec) for spec in self.codecs]
        return [k for k in keys if not self.store.persisted(k.storage_key)]

    def ensure_stored(self, token_ids: Sequence[int]) -> ChunkResult:
        """Compute and store the chunk's cache at every codec unless all are stored."""
        self.ensure_transform([token_ids])  # a no-op once the transform is known (indexing ensures it first)
        missing = self.missing(token_ids)
        if not missing:
            return ChunkResult(computed=False)
        adapt_threads()  # indexing is long: follow the cores other processes leave free (RAGKV_THREADS)
        saliency = None
        if any(codec.get_codec(k.codec.name).wants_saliency(k.codec.level) for k in missing):
            # salient-token levels rank tokens by the attention they receive in their own prefill
            # (the probe runs eager fp32 attention: slower, so only when a level uses it)
            probe = AttentionProbe(None)
            kv = self.adapter.prefill_kv(token_ids, past=[self.prefix_kv()], probe=probe)
            saliency = normalized_attention(probe.weights, kv.num_tokens)
        else:
            kv = self.adapter.prefill_kv(token_ids, past=[self.prefix_kv()])
        written = [self.put(kv, k, saliency) for k in missing]
        return ChunkResult(
            computed=True,
            entries=tuple(e for e in written if e is not None),
            stored=all(e is not None for e in written),
        )

    def put(self, kv: ChunkKV, key: ChunkKey, saliency: torch.Tensor | None = None) -> StoredEntry | None:
        """Encode ``kv`` as ``key`` says, bound to its storage key (and signed, with a store secret); store it.

        ``saliency`` (``[tokens]``, see :func:`ragkv.codec.saliency.normalized_attention`) ranks
        tokens for codec levels that keep salient ones finer; None lets the codec use its proxy.

        A key naming a channel transform this process does not hold (one made before any could
        be calibrated: a 1-token chunk) is stored under its key without the transform instead,
        which the transform setting never looks up: a wasted write, never a wrong answer.

        Returns:
            The entry to record, or None when no tier accepted it (down, full, read-only).
        """
        transform = None
        if key.transform_digest:
            transform = self.transforms.find(key.transform_digest)
            if transform is None:
                logger.warning(
                    "no channel transform %s here; storing the chunk uncoded in it", key.transform_digest[:16]
                )
                key = dataclasses.replace(key, transform_digest="")
        enc = codec.encode(
            kv, key.codec, key=key.storage_key, secret=self.store_secret, saliency=saliency, transform=transform
        )
        if not self.store.put(key.storage_key, enc.data, cost=float(kv.num_tokens)):
            logger.warning("no store tier accepted the cache entry %s (%d bytes)", key.storage_key, enc.nbytes)
            return None
        return StoredEntry(
            storage_key=key.storage_key,
            tokens_digest=key.tokens_digest,
            codec=key.codec.name,
            level=key.codec.level,
            nbytes=enc.nbytes,
            num_tokens=kv.num_tokens,
        )

    def compute_local(self, segments: Sequence[tuple[int, ...]]) -> Iterator[tuple[int, ChunkResult]]:
        """The single-process :data:`ComputeFn`: each chunk in turn, in this process."""
        for i, token_ids in enumerate(segments):
            yield i, self.ensure_stored(token_ids)
