"""KVRetriever: documents -> chunks -> embeddings (FAISS) and chunk KV caches (store), and back.

At index time it chunks each document, embeds the chunks, precomputes every chunk's KV after the
shared prefix, encodes it and stores it. At query time it retrieves the top-k chunks and loads
their caches; a missing, damaged, foreign or stale entry is a miss, and the chunk is recomputed
and stored again.

Crash safety: chunk caches are content-addressed and written before the catalog row that points
at them, so a run killed midway resumes without recomputing what was stored; the FAISS file is
reconciled with the catalog (the source of truth) when opened.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ragkv import codec
from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.cache.prefetch import prefetch
from ragkv.cache.store import TieredStore
from ragkv.digests import fields_digest, text_digest, tokens_digest
from ragkv.errors import CodecError
from ragkv.model import ModelAdapter
from ragkv.retriever.chunker import Chunker, ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.index import FaissIndex
from ragkv.types import DEFAULT_TENANT, Chunk, ChunkKey, ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["IndexReport", "KVRetriever", "RetrieverConfig", "LoadedChunk"]


@dataclass(frozen=True, slots=True)
class RetrieverConfig:
    """Indexing and retrieval settings."""

    top_k: int = 4  # chunks retrieved per question
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    codec: str = "raw"  # codec used when loading
    level: int = 0  # level used when loading
    index_levels: tuple[tuple[str, int], ...] = (("raw", 0),)  # (codec, level) pairs stored at index time
    tenant: str = DEFAULT_TENANT  # namespace of catalog rows and cache entries
    system: str | None = None  # system prompt (None = ragkv.prompt.DEFAULT_SYSTEM)


@dataclass(slots=True)
class IndexReport:
    """What an indexing run did."""

    documents: int = 0  # documents seen
    unchanged: int = 0  # documents skipped because their content was already indexed
    chunks: int = 0  # chunks of new or changed documents
    computed: int = 0  # chunk caches prefilled by this run
    reused: int = 0  # chunk caches already in the store
    bytes_stored: int = 0  # encoded bytes written
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadedChunk:
    """A chunk's cache as the query path gets it."""

    kv: ChunkKV
    hit: bool  # True: loaded from the store; False: computed now (and stored)
    nbytes: int  # encoded bytes read (hits) or written (misses)


class KVRetriever:
    """Indexes documents into chunks, embeddings and chunk caches; retrieves and loads them."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: TieredStore,
        catalog: Catalog,
        index: FaissIndex,
        embedder: Embedder,
        config: RetrieverConfig | None = None,
    ) -> None:
        self.adapter, self.store, self.catalog = adapter, store, catalog
        self.index, self.embedder = index, embedder
        self.config = config or RetrieverConfig()
        if self.config.top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.layout = adapter.layout(self.config.system)
        self.chunker = Chunker(lambda t: len(adapter.encode(t)), self.config.chunker)
        self._prefix_ids = adapter.encode(self.layout.prefix)
        self._prefix_kv: ChunkKV | None = None
        self._reconcile()

    # ---- keys and the shared prefix --------------------------------------------------------
    @property
    def prefix_ids(self) -> list[int]:
        return list(self._prefix_ids)

    def prefix_kv(self) -> ChunkKV:
        """The exact KV of the shared prefix (computed once per process)."""
        if self._prefix_kv is None:
            self._prefix_kv = self.adapter.prefill_kv(self._prefix_ids)
        return self._prefix_kv

    def chunk_key(self, token_ids: Sequence[int], codec_name: str, level: int) -> ChunkKey:
        return ChunkKey(
            model_fingerprint=self.adapter.fingerprint,
            tokenizer_fingerprint=self.adapter.tokenizer_fingerprint,
            prefix_digest=tokens_digest(self._prefix_ids),
            tokens_digest=tokens_digest(token_ids),
            codec=codec_name,
            level=level,
            format_version=codec.FORMAT_VERSION,
            tenant=self.config.tenant,
        )

    def chunk_token_ids(self, text: str) -> tuple[int, ...]:
        """The tokens a chunk contributes to a prompt (its text as laid out, tokenized on its own)."""
        return tuple(self.adapter.encode(self.layout.chunk_text(text)))

    # ---- indexing -----------------------------------------------------------------------------
    def index_documents(self, documents: Sequence[Document], *, progress: bool = True) -> IndexReport:
        """Chunk, embed and precompute caches for ``documents``; unchanged documents cost nothing."""
        t0 = time.perf_counter()
        report = IndexReport(documents=len(documents))
        tenant = self.config.tenant
        todo = []
        for doc in documents:
            digest = text_digest(doc.text)
            old = self.catalog.get_document(doc.source, tenant)
            if old is not None and old.content_digest == digest:
                report.unchanged += 1
                continue
            todo.append((doc, digest))
        chunked = [(doc, digest, self._chunk(doc, digest)) for doc, digest in todo]  # cheap next to prefill
        bar = tqdm(
            total=sum(len(c) for _, _, c in chunked),
            desc="indexing chunks",
            unit="chunk",
            disable=not progress or not todo,
        )
        for doc, digest, chunks in chunked:
            for chunk in chunks:  # caches first: a killed run leaves them reusable, never half-visible
                computed, nbytes = self._ensure_stored(chunk.token_ids)
                report.computed += computed
                report.reused += not computed
                report.bytes_stored += nbytes
                bar.update(1)
            record = DocumentRecord(
                doc_id=chunks[0].doc_id,
                tenant=tenant,
                source=doc.source,
                content_digest=digest,
                title=doc.title,
                num_chunks=len(chunks),
            )
            removed = self.catalog.remove_document(doc.source, tenant)
            if removed:
                self.index.remove(removed)
            rows = self.catalog.replace_document(record, chunks)
            self.index.add(rows, self.embedder.embed([c.text for c in chunks]))
            self.index.save()
            report.chunks += len(chunks)
        bar.close()
        report.seconds = time.perf_counter() - t0
        return report

    def _chunk(self, doc: Document, digest: str) -> list[Chunk]:
        doc_id = fields_digest([("source", doc.source), ("content", digest), ("tenant", self.config.tenant)])
        chunks = []
        # chunk text is kept stripped: frameworks strip retrieved text before pasting it into their
        # prompts, so the stripped form is what a prompt contains and what the cache is made of
        texts = [t for t in (s.text.strip() for s in self.chunker.split(doc.text)) if t]
        for i, text in enumerate(texts):
            chunks.append(
                Chunk(
                    chunk_id=fields_digest([("doc", doc_id), ("ordinal", i), ("text", text_digest(text))]),
                    doc_id=doc_id,
                    ordinal=i,
                    text=text,
                    token_ids=self.chunk_token_ids(text),
                    source=doc.source,
                )
            )
        return chunks

    def ensure(self, token_ids: Sequence[int]) -> bool:
        """Store the chunk's cache unless present (and promote it to the fast tiers); True if computed."""
        computed, _ = self._ensure_stored(token_ids)
        if not computed:
            self.store.get(self.chunk_key(token_ids, self.config.codec, self.config.level).storage_key)
        return computed

    def _ensure_stored(self, token_ids: Sequence[int]) -> tuple[bool, int]:
        """Compute and store the chunk's cache at every index level unless all are stored."""
        keys = [(c, lvl, self.chunk_key(token_ids, c, lvl)) for c, lvl in self.config.index_levels]
        missing = [(c, lvl, k) for c, lvl, k in keys if not self.store.contains(k.storage_key)]
        if not missing:
            return False, 0
        kv = self.adapter.prefill_kv(token_ids, past=[self.prefix_kv()])
        return True, sum(self._put(kv, k, c, lvl) for c, lvl, k in missing)

    def _put(self, kv: ChunkKV, key: ChunkKey, codec_name: str, level: int) -> int:
        enc = codec.encode(kv, codec_name, level)
        self.store.put(key.storage_key, enc.data, cost=float(kv.num_tokens))
        self.catalog.record_entry(
            key.storage_key,
            tenant=self.config.tenant,
            tokens_digest=key.tokens_digest,
            codec=codec_name,
            level=level,
            nbytes=enc.nbytes,
            num_tokens=kv.num_tokens,
        )
        return enc.nbytes

    def _reconcile(self) -> None:
        """Make the FAISS index hold exactly the catalog's chunk rows (the catalog is the truth)."""
        rows = set(self.catalog.all_chunk_rows(self.config.tenant))
        have = set(self.index.ids())
        stale = have - rows
        if stale:
            self.index.remove(sorted(stale))
        missing = sorted(rows - have)
        if missing:
            logger.info("re-embedding %d chunks missing from the FAISS index", len(missing))
            chunks = self.catalog.chunks_by_rows(missing, self.config.tenant)
            self.index.add(missing, self.embedder.embed([c.text for c in chunks]))
        if stale or missing:
            self.index.save()

    # ---- query time ---------------------------------------------------------------------------
    def retrieve(self, query: str, k: int | None = None) -> list[Chunk]:
        """The top-``k`` chunks for ``query``, best first, with their similarity scores."""
        if not query.strip():
            raise ValueError("the question is empty; pass some text to retrieve for")
        if len(self.index) == 0:
            return []
        hits = self.index.search(self.embedder.embed([query])[0], k or self.config.top_k)
        by_row = {row: score for row, score in hits}  # type: ignore[misc]
        chunks = self.catalog.chunks_by_rows(list(by_row), self.config.tenant)
        rows = [row for row, _ in hits]  # type: ignore[misc]
        return [
            Chunk(c.chunk_id, c.doc_id, c.ordinal, c.text, c.token_ids, c.source, float(by_row[r]))
            for r, c in zip(rows, chunks, strict=False)
        ]

    def load(self, token_ids: Sequence[int]) -> LoadedChunk:
        """The chunk's cache: from the store, or computed now (and stored) on a miss."""
        return self.load_many([token_ids])[0]

    def load_many(self, segments: Sequence[Sequence[int]]) -> list[LoadedChunk]:
        """Several chunks' caches, in order; misses and unusable entries are computed and stored.

        With more than one chunk, blobs are fetched on a background thread, in order, while the
        main thread decodes the ones already fetched: chunk i+1 loads from its tier while chunk i
        decodes, so a remote tier's latency hides behind decoding. Only the fetch thread touches
        the store until every fetch is done; the misses are then computed and stored, and the
        hits' catalog entries touched in one write. A chunk that occurs twice is fetched once; its
        repeat counts as a hit of 0 bytes (its cache was loaded or computed for the first occurrence).
        """
        keys = [self.chunk_key(t, self.config.codec, self.config.level) for t in segments]
        first: dict[str, int] = {}  # storage key -> index of its first occurrence
        for i, key in enumerate(keys):
            first.setdefault(key.storage_key, i)
        unique = list(first.values())  # a chunk repeated in one prompt is fetched and decoded once
        sizes: dict[int, int | None] = {}  # bytes of each stored blob (None: not stored)
        decoded: dict[int, ChunkKV | None] = {}
        storage_keys = [keys[i].storage_key for i in unique]
        with contextlib.closing(prefetch(storage_keys, self.store.get)) as fetched:
            for i, blob in zip(unique, fetched, strict=True):
                # the next chunks keep loading while this one decodes; its bytes are dropped after
                sizes[i] = None if blob is None else len(blob)
                decoded[i] = None if blob is None else self._decode(keys[i], len(segments[i]), blob)
        done: dict[int, LoadedChunk] = {}
        for i in unique:
            kv, size = decoded[i], sizes[i]
            if kv is not None and size is not None:
                done[i] = LoadedChunk(kv, True, size)
                continue
            if size is not None:  # present but unusable: drop it everywhere, then recompute
                self.store.invalidate(keys[i].storage_key)
            kv = self.adapter.prefill_kv(segments[i], past=[self.prefix_kv()])
            done[i] = LoadedChunk(kv, False, self._put(kv, keys[i], self.config.codec, self.config.level))
        hits = [keys[i].storage_key for i in unique if done[i].hit]
        if hits:
            self.catalog.touch_entries(hits)
        out = []
        for i, key in enumerate(keys):
            j = first[key.storage_key]
            # a repeat reuses the cache its first occurrence loaded or computed: nothing to prefill,
            # nothing read
            out.append(done[j] if i == j else LoadedChunk(done[j].kv, True, 0))
        return out

    def _decode(self, key: ChunkKey, num_tokens: int, blob: bytes) -> ChunkKV | None:
        """The stored cache in ``blob``, or None (with a warning) if it is damaged, foreign or stale."""
        try:
            kv = codec.decode(
                blob,
                device=self.adapter.device,
                dtype=self.adapter.dtype,
                expect_model_fingerprint=self.adapter.fingerprint,
            )
        except CodecError as e:
            logger.warning("unusable cache entry %s (%s); recomputing", key.storage_key, e)
            return None
        if kv.num_tokens != num_tokens:
            logger.warning(
                "cache entry %s has %d tokens, chunk has %d; recomputing", key.storage_key, kv.num_tokens, num_tokens
            )
            return None
        return kv
