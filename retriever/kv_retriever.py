"""KVRetriever: documents -> chunks -> embeddings (FAISS) and chunk KV caches (store), and back.

Loading at query time is :class:`~ragkv.retriever.loader.ChunkLoader`'s (``self.loader``); this
module indexes and retrieves.

At index time it chunks each document, embeds the chunks, precomputes every chunk's KV after the
shared prefix, encodes it and stores it. At query time it retrieves the top-k chunks and loads
their caches; a missing, damaged, foreign or stale entry is a miss, and the chunk is recomputed
and stored again.

Crash safety: chunk caches are content-addressed and written before the catalog row that points
at them, so a run killed midway resumes without recomputing what was stored; the FAISS file is
reconciled with the catalog (the source of truth) when opened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import cast

from tqdm.auto import tqdm

from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.cache.store import TieredStore
from ragkv.digests import Digest, fields_digest, text_digest
from ragkv.gpu.host_tier import HostTier
from ragkv.gpu.tier import DeviceTier
from ragkv.model import ModelAdapter
from ragkv.retriever.chunker import Chunker
from ragkv.retriever.commit import commit_documents
from ragkv.retriever.documents import Document, document_source
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.index import FaissIndex
from ragkv.retriever.loader import ChunkLoader, LoadedChunk
from ragkv.retriever.precompute import ChunkComputer, ChunkResult, ComputeFn, StoredEntry, record_stored
from ragkv.retriever.records import (
    IndexPlan,
    IndexProgress,
    IndexReport,
    ProgressFn,
    RemoveReport,
    RetrieverConfig,
)
from ragkv.retriever.removal import forget_chunks, live_token_ids, remove_document
from ragkv.types import Chunk, validate_tenant

logger = logging.getLogger(__name__)


def batch_chunks(index_size: int) -> int:
    """How many chunks of ready documents to commit together, for an index of ``index_size`` vectors.

    Each commit re-writes (and fsyncs) the whole FAISS file: one commit per document made indexing
    10,000 small files quadratic. Batches of a quarter of the index keep the total written linear in
    its final size, at the price of redoing up to that many documents' embeddings after a crash
    (their caches are stored and recorded already).
    """
    return max(64, index_size // 4)


__all__ = [
    "IndexPlan",
    "IndexProgress",
    "IndexReport",
    "KVRetriever",
    "LoadedChunk",
    "ProgressFn",
    "RemoveReport",
    "RetrieverConfig",
]


class KVRetriever:
    """Indexes documents into chunks, embeddings and chunk caches, and retrieves them.

    Its parts are public and called directly: ``computer`` (:class:`ChunkComputer`: the shared prefix's KV,
    chunk keys, prefill + encode + store) and ``loader`` (:class:`ChunkLoader`: chunk caches at query time).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        store: TieredStore,
        catalog: Catalog,
        index: FaissIndex,
        embedder: Embedder,
        config: RetrieverConfig | None = None,
        *,
        tenant: str,
        store_secret: bytes | None = None,
        device_tier: DeviceTier | None = None,
        host_tier: HostTier | None = None,
    ) -> None:
        self.adapter, self.store, self.catalog = adapter, store, catalog
        self.index, self.embedder = index, embedder
        self.config = config or RetrieverConfig()
        self.tenant = validate_tenant(tenant)  # namespace of catalog rows and cache entries
        self.store_secret = store_secret  # MAC key material for stored entries (None: unauthenticated)
        self.layout = adapter.layout(self.config.system)
        self.chunker = Chunker(lambda t: len(adapter.encode(t)), self.config.chunker)
        self._prefix_ids = adapter.encode(self.layout.prefix)
        # prefill + encode + store: the part of indexing that runs in Ray actors too
        self.computer = ChunkComputer(
            adapter,
            store,
            self._prefix_ids,
            self.config.stored_codecs,
            tenant=self.tenant,
            store_secret=store_secret,
            transform=self.config.transform,
        )
        self.loader = ChunkLoader(
            self.computer,
            catalog,
            codec=self.config.codec,
            stored_codecs=self.config.stored_codecs,
            store_secret=store_secret,
            device_tier=device_tier,
            host_tier=host_tier,
            decode_workers=self.config.decode_workers,
        )
        self._reconcile()

    # ---- keys and the shared prefix --------------------------------------------------------
    @property
    def prefix_ids(self) -> list[int]:
        return list(self._prefix_ids)

    def chunk_token_ids(self, text: str) -> tuple[int, ...]:
        """The tokens a chunk contributes to a prompt (its text as laid out, tokenized on its own)."""
        return tuple(self.adapter.encode(self.layout.chunk_text(text)))

    # ---- indexing -----------------------------------------------------------------------------
    def index_documents(
        self,
        documents: Sequence[Document],
        *,
        progress: bool = True,
        compute: ComputeFn | None = None,
        on_progress: ProgressFn | None = None,
    ) -> IndexReport:
        """Chunk, embed and precompute caches for ``documents``; documents already indexed cost little.

        A document is skipped as unchanged only if the catalog holds it with this content, all
        its chunk rows, the FAISS index all their vectors, and the store every chunk's cache at
        every stored codec. Otherwise it is redone, reusing the caches still stored, so a damaged
        catalog or a lost cache heals on the next run. A document with a chunk cache that no tier
        accepted is not committed (any older version of it stays) and is reported in
        ``failed_documents``, so the next run retries it.

        Args:
            documents: what to index.
            progress: show a progress bar over the chunks to prefill.
            compute: runs the precompute of the planned chunks (default: in this process, in
                order; :func:`ragkv.retriever.ray_index.ray_compute` runs it on a Ray cluster).
                Plan and commit are the same whichever runs it.
            on_progress: called on this thread after each step of each phase (see
                :class:`IndexProgress`); what it raises aborts the run like any error.

        Raises:
            ValueError: a document has an empty source.
        """
        t0 = time.perf_counter()
        plan = self.plan_index(documents, on_progress=on_progress)
        bar = tqdm(
            total=len(plan.work),
            desc="prefilling chunks",
            unit="chunk",
            disable=not progress or not plan.work,
        )
        results: dict[tuple[int, ...], ChunkResult] = {}
        pending = iter(plan.documents)  # committed in plan order, so catalog rows are the same for any executor
        waiting = next(pending, None)
        run = compute or self.computer.compute_local
        emit = on_progress or (lambda _: None)
        if plan.work:
            emit(IndexProgress("precompute", 0, len(plan.work)))
        try:
            for i, result in run(plan.work):
                for entry in result.entries:  # caches first: a killed run leaves them reusable, never half-visible
                    self._record(entry)
                results[plan.work[i]] = result
                bar.update(1)
                if not result.ok:
                    bar.set_postfix(failed=sum(not r.ok for r in results.values()))
                emit(IndexProgress("precompute", len(results), len(plan.work)))
                waiting = self._commit_ready(plan, results, waiting, pending, emit)
        except BaseException:  # interrupted: what is complete is committed (a failed commit stays unsaid)
            try:
                self._commit(plan)
            except Exception as e:
                logger.warning("could not commit the documents complete before the interruption: %s", e)
            raise
        finally:
            bar.close()
        if self._commit_ready(plan, results, waiting, pending, emit) is not None:
            raise RuntimeError("the compute function returned before every planned chunk had a result")
        self._commit(plan)  # the last batch
        if plan.documents:
            self._reconcile()  # rows lost from the catalog by hand leave vectors no commit removed
        plan.report.seconds = time.perf_counter() - t0
        return plan.report

    def plan_index(self, documents: Sequence[Document], *, on_progress: ProgressFn | None = None) -> IndexPlan:
        """Which documents to (re)index, their chunks, and the distinct chunks whose caches are missing.

        ``on_progress`` hears a ``chunking`` step per new or changed document.
        """
        report = IndexReport(documents=len(documents))
        self.index.refresh()  # another process on this data dir may have saved since (one stat if not)
        todo: dict[str, tuple[Document, Digest]] = {}  # source -> (document, content digest)
        replacing: set[str] = set()  # sources indexed before, with other content (or damaged)
        for doc in documents:
            doc = replace(doc, source=document_source(doc))
            digest = text_digest(doc.text)
            old = self.catalog.get_document(doc.source, self.tenant)
            if (doc.source in todo and todo[doc.source][1] == digest) or self._is_indexed(old, digest):
                report.unchanged += 1
            else:
                todo[doc.source] = (doc, digest)
                if old is not None:
                    replacing.add(doc.source)
        chunked: list[tuple[Document, Digest, list[Chunk]]] = []  # chunking is cheap next to prefill
        for doc, digest in todo.values():
            chunked.append((doc, digest, self._chunk(doc, digest)))
            if on_progress is not None:
                on_progress(IndexProgress("chunking", len(chunked), len(todo)))
        # a stored codec coded in the channel transform needs it before any key is made: read, or
        # calibrated from the first chunks of this run (their prefill is repeated below: once per model)
        self.computer.ensure_transform([c.token_ids for _, _, chunks in chunked for c in chunks])
        seen: set[tuple[int, ...]] = set()
        work = []
        for _, _, chunks in chunked:
            for chunk in chunks:
                if chunk.token_ids not in seen:
                    seen.add(chunk.token_ids)
                    if self.computer.missing(chunk.token_ids):  # stored chunks are skipped before scheduling
                        work.append(chunk.token_ids)
        return IndexPlan(report, chunked, work, replacing=replacing)

    def _commit_ready(
        self,
        plan: IndexPlan,
        results: dict[tuple[int, ...], ChunkResult],
        waiting: tuple[Document, Digest, list[Chunk]] | None,
        pending: Iterator[tuple[Document, Digest, list[Chunk]]],
        emit: ProgressFn,
    ) -> tuple[Document, Digest, list[Chunk]] | None:
        """Commit (or report as failed) the documents, in plan order, whose chunks all have results.

        Returns:
            The first document still waiting for a chunk, or None when every document is done.
        """
        report = plan.report
        while waiting is not None:
            doc, digest, chunks = waiting
            if any(c.token_ids not in results for c in chunks if c.token_ids in plan.scheduled):
                return waiting
            failed = 0
            for chunk in chunks:
                # a chunk's work counts at its first occurrence in the run; later ones reused it
                result = results.get(chunk.token_ids, ChunkResult(computed=False))
                first = chunk.token_ids not in plan.counted
                plan.counted.add(chunk.token_ids)
                report.computed += first and result.computed
                report.reused += not (first and result.computed)
                report.bytes_stored += result.nbytes if first else 0
                failed += not result.ok
                report.failed += first and not result.ok  # distinct chunks not stored
                if first and result.error is not None:
                    report.errors.append(f"{doc.source}#{chunk.ordinal}: {result.error}")
            self._finish(plan, doc, digest, chunks, failed)
            plan.finished += 1
            emit(IndexProgress("embedding", plan.finished, len(plan.documents)))
            waiting = next(pending, None)
        return None

    def _finish(self, plan: IndexPlan, doc: Document, digest: Digest, chunks: list[Chunk], failed: int) -> None:
        """Queue a document whose chunk caches are all stored for the next commit; otherwise report it
        for the next run."""
        report = plan.report
        if failed:
            logger.warning(
                "%s: %d of its %d chunk caches were not stored; not indexing it (the next run retries)",
                doc.source,
                failed,
                len(chunks),
            )
            report.failed_documents.append(doc.source)
            return
        plan.ready.append((doc, digest, chunks))
        if sum(len(c) for _, _, c in plan.ready) >= batch_chunks(len(self.index)):
            self._commit(plan)

    def _is_indexed(self, old: DocumentRecord | None, digest: str) -> bool:
        """Whether ``old`` (a source's catalog record) is indexed with content ``digest``: document,
        chunk rows, vectors and caches."""
        if old is None or old.content_digest != digest:
            return False
        rows = self.catalog.document_chunks(old.source, self.tenant)
        if len(rows) != old.num_chunks or any(row not in self.index for row in rows):
            return False
        return all(
            self.store.persisted(self.computer.chunk_key(chunk.token_ids, spec).storage_key)
            for chunk in rows.values()
            for spec in self.config.stored_codecs
        )

    def _commit(self, plan: IndexPlan) -> None:
        """Commit the ready documents to the catalog and the FAISS index, together (see
        :func:`~ragkv.retriever.commit.commit_documents`)."""
        batch, plan.ready = plan.ready, []
        # the versions these documents replace: their chunks no document keeps lose their caches below
        replaced = {
            doc.source: [c.token_ids for c in self.catalog.document_chunks(doc.source, self.tenant).values()]
            for doc, _, _ in batch
            if doc.source in plan.replacing
        }
        records = [
            (
                DocumentRecord(
                    doc_id=self._doc_id(doc, digest),
                    tenant=self.tenant,
                    source=doc.source,
                    content_digest=digest,
                    title=doc.title,
                    num_chunks=len(chunks),
                ),
                chunks,
            )
            for doc, digest, chunks in batch
        ]
        plan.report.chunks += commit_documents(self.catalog, self.index, self.embedder, records)
        if any(replaced.values()):
            live = live_token_ids(self)  # once per batch, not per replaced document
            for source, token_ids in replaced.items():
                forget_chunks(self, source, token_ids, live)

    def _doc_id(self, doc: Document, digest: str) -> Digest:
        return fields_digest([("source", doc.source), ("content", digest), ("tenant", self.tenant)])

    def _chunk(self, doc: Document, digest: str) -> list[Chunk]:
        doc_id = self._doc_id(doc, digest)
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
        computed, _, _ = self._ensure_stored(token_ids)
        if not computed:
            self.store.get(self.computer.chunk_key(token_ids, self.config.codec).storage_key)
        return computed

    def _ensure_stored(self, token_ids: Sequence[int]) -> tuple[bool, int, bool]:
        """Compute and store the chunk's cache at every stored codec unless all are stored.

        Returns:
            (computed, bytes some tier accepted, whether every codec's cache is now stored).
        """
        result = self.computer.ensure_stored(token_ids)
        for entry in result.entries:
            self._record(entry)
        return result.computed, result.nbytes, result.stored

    def _record(self, entry: StoredEntry) -> None:
        record_stored(self.catalog, entry, tenant=self.tenant)

    def sync_index(self) -> None:
        """Make the FAISS index hold exactly the catalog's chunk rows (what opening the retriever does),
        for a long-running process whose catalog other processes write to."""
        self._reconcile()

    def _reconcile(self) -> None:
        """Make the FAISS index hold exactly the catalog's chunk rows (the catalog is the truth)."""
        rows = set(self.catalog.all_chunk_rows(self.tenant))
        have = set(self.index.ids())
        stale = have - rows
        if stale:
            self.index.remove(sorted(stale))
        missing = sorted(rows - have)
        if missing:
            logger.info("re-embedding %d chunks missing from the FAISS index", len(missing))
            chunks = self.catalog.chunks_by_rows(missing, self.tenant)
            self.index.add(missing, self.embedder.embed([c.text for c in chunks]))
        if stale or missing:
            self.index.save()

    # ---- query time ---------------------------------------------------------------------------
    def remove_document(self, source: str) -> RemoveReport:
        """Forget document ``source`` of this tenant: catalog rows, FAISS entries and its stored caches.

        A cache entry goes only when no other document of the tenant still has a chunk with the same
        tokens (entries are keyed by content, so two documents may share one). Every entry of such a
        chunk goes, whatever it was coded with: the keys this retriever makes now, and every entry the
        catalog recorded for the chunk's tokens (other levels, a channel transform replaced since, an
        older system prompt). The caller keeps retrieval off the FAISS index meanwhile (``RagKV.remove``
        holds its index lock).

        Cache entries a tier could not delete (read-only, down) keep their catalog rows and are
        counted in ``pending``; removing the same source again finishes them (see
        :mod:`ragkv.retriever.removal`).
        """
        return remove_document(self, source)

    def retrieve(self, query: str, k: int | None = None) -> list[Chunk]:
        """The top-``k`` distinct chunks for ``query``, best first, with their similarity scores.

        A chunk comes back once even if several rows hold it (the same text in several documents,
        or one file indexed under several names by an older ragkv): FAISS is asked for more
        neighbours until ``k`` distinct chunks are found or the index is exhausted.
        """
        if not query.strip():
            raise ValueError("the question is empty; pass some text to retrieve for")
        want = self.config.top_k if k is None else k
        if want < 1:
            raise ValueError(f"k must be >= 1 (chunks to retrieve); got {want}")
        vector = self.embedder.embed([query])[0]
        out: list[Chunk] = []
        looked: set[int] = set()  # rows already considered
        seen: set[str] = set()  # chunk ids and texts already returned
        ask = want
        while True:
            hits = cast(list[tuple[int, float]], self.index.search(vector, ask)) if len(self.index) else []
            # FAISS orders tied scores arbitrarily, differently for each k: rows of an earlier, smaller
            # search keep their places and only new rows are appended, so the top hits stay the top hits
            fresh = [(row, score) for row, score in hits if row not in looked]
            looked.update(row for row, _ in fresh)
            found = self.catalog.chunk_map([row for row, _ in fresh], self.tenant)
            for row, score in fresh:
                c = found.get(row)
                if c is None or c.chunk_id in seen or c.text in seen:
                    continue
                seen.update((c.chunk_id, c.text))
                out.append(Chunk(c.chunk_id, c.doc_id, c.ordinal, c.text, c.token_ids, c.source, float(score)))
                if len(out) == want:
                    return out
            if len(hits) < ask or ask >= len(self.index):
                return out  # every row was looked at
            ask = min(ask * 2, len(self.index))
