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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from tqdm.auto import tqdm

from ragkv import codec
from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.cache.fetched import Fetched
from ragkv.cache.store import TieredStore
from ragkv.digests import Digest, fields_digest, text_digest
from ragkv.errors import CodecError
from ragkv.model import ModelAdapter
from ragkv.planner.plan import LOCAL, TEXT, ChunkOptions
from ragkv.planner.session import LoadPlanning, LoadSession
from ragkv.retriever.chunker import Chunker, ChunkerConfig
from ragkv.retriever.documents import Document, document_source
from ragkv.retriever.embedder import Embedder
from ragkv.retriever.index import FaissIndex
from ragkv.retriever.precompute import ChunkComputer, ChunkResult, ComputeFn, StoredEntry
from ragkv.retriever.prefetch import prefetch
from ragkv.types import DEFAULT_CODEC, Chunk, ChunkKey, ChunkKV, CodecSpec, validate_tenant

logger = logging.getLogger(__name__)

__all__ = ["IndexPlan", "IndexProgress", "IndexReport", "KVRetriever", "RetrieverConfig", "LoadedChunk", "ProgressFn"]


@dataclass(frozen=True, slots=True)
class RetrieverConfig:
    """Indexing and retrieval settings (the tenant and the store secret are the caller's identity,
    passed to :class:`KVRetriever` on their own)."""

    top_k: int = 4  # chunks retrieved per question
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    codec: CodecSpec = DEFAULT_CODEC  # codec and level chunks are stored and loaded at
    index_codecs: tuple[CodecSpec, ...] = ()  # further (codec, level) pairs stored at index time
    system: str | None = None  # system prompt (None = ragkv.prompt.DEFAULT_SYSTEM)

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1 (chunks retrieved per question); got {self.top_k!r}")
        if not isinstance(self.codec, CodecSpec) or not all(isinstance(c, CodecSpec) for c in self.index_codecs):
            raise TypeError("codec and index_codecs take CodecSpec records, e.g. CodecSpec('cachegen', 0)")

    @property
    def stored_codecs(self) -> tuple[CodecSpec, ...]:
        """Every (codec, level) written at index time: ``codec`` first, then ``index_codecs``."""
        return tuple(dict.fromkeys((self.codec, *self.index_codecs)))


@dataclass(slots=True)
class IndexReport:
    """What an indexing run did."""

    documents: int = 0  # documents seen
    unchanged: int = 0  # documents skipped: same content, all chunk rows, vectors and caches present
    chunks: int = 0  # chunks of new or changed documents
    computed: int = 0  # chunk caches prefilled by this run
    reused: int = 0  # chunk caches already in the store
    bytes_stored: int = 0  # encoded bytes some tier accepted
    failed: int = 0  # distinct chunks whose cache was not stored (their documents were not committed)
    failed_documents: list[str] = field(default_factory=list)  # sources not committed, to retry
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # "source#chunk: error" of chunks whose precompute raised


@dataclass(frozen=True, slots=True)
class IndexProgress:
    """One step of an indexing run, for a progress display (``ragkv serve`` streams them)."""

    # "chunking": new or changed documents cut into chunks; "precompute": distinct chunk caches
    # prefilled (the long part); "embedding": documents embedded and committed to catalog and index
    phase: str
    done: int
    total: int


ProgressFn = Callable[[IndexProgress], None]


@dataclass(slots=True)
class IndexPlan:
    """What an indexing run will do, decided before any prefill (see :meth:`KVRetriever.plan_index`)."""

    report: IndexReport  # documents and unchanged filled in; the rest is counted as work lands
    documents: list[tuple[Document, Digest, list[Chunk]]]  # new or changed documents, chunked, in order
    work: list[tuple[int, ...]]  # distinct chunks (token ids) with a cache missing, in first-seen order
    scheduled: set[tuple[int, ...]] = field(default_factory=set)  # the chunks of ``work``
    counted: set[tuple[int, ...]] = field(default_factory=set)  # chunks already counted in the report
    finished: int = 0  # documents committed or reported failed so far

    def __post_init__(self) -> None:
        self.scheduled = set(self.work)


@dataclass(frozen=True, slots=True)
class LoadedChunk:
    """A chunk's cache as the query path gets it."""

    kv: ChunkKV
    hit: bool  # True: loaded from the store; False: computed now (and stored)
    nbytes: int  # encoded bytes read (hits) or written (misses)
    recompute: bool = False  # True: not loaded (planned as text, or its tier failed); kv is a placeholder
    local: bool = False  # True: stored, but prefilled here while other chunks were fetched (planned LOCAL)


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
        *,
        tenant: str,
        store_secret: bytes | None = None,
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
        )
        self._reconcile()

    # ---- keys and the shared prefix --------------------------------------------------------
    @property
    def prefix_ids(self) -> list[int]:
        return list(self._prefix_ids)

    def prefix_kv(self) -> ChunkKV:
        """The exact KV of the shared prefix (computed once per process)."""
        return self.computer.prefix_kv()

    def chunk_key(self, token_ids: Sequence[int], spec: CodecSpec) -> ChunkKey:
        """The key of the chunk ``token_ids`` encoded with ``spec``, for this model, prefix and tenant."""
        return self.computer.chunk_key(token_ids, spec)

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
        for i, result in run(plan.work):
            for entry in result.entries:  # caches first: a killed run leaves them reusable, never half-visible
                self._record(entry)
            results[plan.work[i]] = result
            bar.update(1)
            if not result.ok:
                bar.set_postfix(failed=sum(not r.ok for r in results.values()))
            emit(IndexProgress("precompute", len(results), len(plan.work)))
            waiting = self._commit_ready(plan, results, waiting, pending, emit)
        bar.close()
        if self._commit_ready(plan, results, waiting, pending, emit) is not None:
            raise RuntimeError("the compute function returned before every planned chunk had a result")
        if plan.documents:
            self._reconcile()  # rows lost from the catalog by hand leave vectors no commit removed
        plan.report.seconds = time.perf_counter() - t0
        return plan.report

    def plan_index(self, documents: Sequence[Document], *, on_progress: ProgressFn | None = None) -> IndexPlan:
        """Which documents to (re)index, their chunks, and the distinct chunks whose caches are missing.

        ``on_progress`` hears a ``chunking`` step per new or changed document.
        """
        report = IndexReport(documents=len(documents))
        todo: dict[str, tuple[Document, Digest]] = {}  # source -> (document, content digest)
        for doc in documents:
            doc = replace(doc, source=document_source(doc))
            digest = text_digest(doc.text)
            if (doc.source in todo and todo[doc.source][1] == digest) or self._is_indexed(doc.source, digest):
                report.unchanged += 1
            else:
                todo[doc.source] = (doc, digest)
        chunked: list[tuple[Document, Digest, list[Chunk]]] = []  # chunking is cheap next to prefill
        for doc, digest in todo.values():
            chunked.append((doc, digest, self._chunk(doc, digest)))
            if on_progress is not None:
                on_progress(IndexProgress("chunking", len(chunked), len(todo)))
        seen: set[tuple[int, ...]] = set()
        work = []
        for _, _, chunks in chunked:
            for chunk in chunks:
                if chunk.token_ids not in seen:
                    seen.add(chunk.token_ids)
                    if self.computer.missing(chunk.token_ids):  # stored chunks are skipped before scheduling
                        work.append(chunk.token_ids)
        return IndexPlan(report, chunked, work)

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
            self._finish(report, doc, digest, chunks, failed)
            plan.finished += 1
            emit(IndexProgress("embedding", plan.finished, len(plan.documents)))
            waiting = next(pending, None)
        return None

    def _finish(self, report: IndexReport, doc: Document, digest: Digest, chunks: list[Chunk], failed: int) -> None:
        """Commit a document whose chunk caches are all stored; otherwise report it for the next run."""
        if failed:
            logger.warning(
                "%s: %d of its %d chunk caches were not stored; not indexing it (the next run retries)",
                doc.source,
                failed,
                len(chunks),
            )
            report.failed_documents.append(doc.source)
            return
        self._commit(doc, digest, chunks)
        report.chunks += len(chunks)

    def _is_indexed(self, source: str, digest: str) -> bool:
        """Whether ``source`` is indexed with content ``digest``: document, chunk rows, vectors and caches."""
        old = self.catalog.get_document(source, self.tenant)
        if old is None or old.content_digest != digest:
            return False
        rows = self.catalog.document_chunks(source, self.tenant)
        if len(rows) != old.num_chunks or any(row not in self.index for row in rows):
            return False
        return all(
            self.store.contains(self.chunk_key(chunk.token_ids, spec).storage_key)
            for chunk in rows.values()
            for spec in self.config.stored_codecs
        )

    def _commit(self, doc: Document, digest: str, chunks: list[Chunk]) -> None:
        """Make ``doc``'s chunks the ones the catalog and the FAISS index hold for its source."""
        record = DocumentRecord(
            doc_id=self._doc_id(doc, digest),
            tenant=self.tenant,
            source=doc.source,
            content_digest=digest,
            title=doc.title,
            num_chunks=len(chunks),
        )
        removed = self.catalog.remove_document(doc.source, self.tenant)
        if removed:
            self.index.remove(removed)
        rows = self.catalog.replace_document(record, chunks)
        if rows:
            self.index.add(rows, self.embedder.embed([c.text for c in chunks]))
        self.index.save()

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
            self.store.get(self.chunk_key(token_ids, self.config.codec).storage_key)
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

    def _put(self, kv: ChunkKV, key: ChunkKey) -> int:
        """Encode ``kv`` as ``key`` says, bound to its storage key (and signed, with a store secret); store it."""
        entry = self.computer.put(kv, key)
        if entry is None:  # no tier took it: record nothing, report 0 bytes stored
            return 0
        self._record(entry)
        return entry.nbytes

    def _record(self, entry: StoredEntry) -> None:
        """Record a stored cache in the catalog (after its bytes are in the store)."""
        self.catalog.record_entry(
            entry.storage_key,
            tenant=self.tenant,
            tokens_digest=entry.tokens_digest,
            codec=entry.codec,
            level=entry.level,
            nbytes=entry.nbytes,
            num_tokens=entry.num_tokens,
        )

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

    def load(self, token_ids: Sequence[int]) -> LoadedChunk:
        """The chunk's cache: from the store, or computed now (and stored) on a miss."""
        return self.load_many([token_ids])[0]

    def load_many(self, segments: Sequence[Sequence[int]], *, plan: LoadPlanning | None = None) -> list[LoadedChunk]:
        """Several chunks' caches, in order; misses and unusable entries are computed and stored.

        With more than one chunk, blobs are fetched on a background thread, in order, while the
        main thread decodes the ones already fetched: chunk i+1 loads from its tier while chunk i
        decodes, so a remote tier's latency hides behind decoding. Only the fetch thread touches
        the store until every fetch is done; the misses are then computed and stored, and the
        hits' catalog entries touched in one write. A chunk that occurs twice is fetched once; its
        repeat counts as a hit of 0 bytes (its cache was loaded or computed for the first occurrence).

        With ``plan``, each chunk's (codec, level) is chosen just before it is fetched, on the speeds
        measured so far (see ``ragkv.planner``); a chunk planned as text, or whose tier fails
        mid-load (and every chunk after it), comes back with ``recompute=True`` and no bytes read:
        fusion computes it from its tokens. A chunk planned as ``LOCAL`` (under a deadline the
        link cannot meet) is prefilled on this thread when its turn comes, while the fetch thread
        reads the next chunks, and comes back with ``local=True`` (not stored again: the store has
        it). Without ``plan``, every chunk loads at ``config.codec``.
        """
        keys = [self.chunk_key(t, self.config.codec) for t in segments]
        first: dict[str, int] = {}  # storage key -> index of its first occurrence
        primary = [key.storage_key for key in keys]  # identifies the chunk (keys[i] may move to another level)
        for i, storage_key in enumerate(primary):
            first.setdefault(storage_key, i)
        unique = list(first.values())  # a chunk repeated in one prompt is fetched and decoded once
        session = None if plan is None else self._session([segments[i] for i in unique], plan)
        fixed = self.config.codec if plan is None or plan.config.fixed is None else plan.config.fixed

        planning = session is not None and plan is not None and plan.config.fixed is None

        def fetch(n: int) -> tuple[ChunkKey | None, Fetched | None]:
            """(key, bytes) read; (None, None): recompute in fusion; (key, None): prefill here."""
            i = unique[n]
            spec = fixed
            if planning and session is not None and session.chunks[n].sizes:  # chunks never stored: a miss
                chosen = session.choose(n)
                if chosen is TEXT:
                    return None, None
                if chosen == LOCAL:
                    return keys[i], None
                assert isinstance(chosen, CodecSpec)
                spec = chosen
            if spec != keys[i].codec:
                keys[i] = self.chunk_key(segments[i], spec)
            if session is None:  # no tier bookkeeping needed: the plain read
                return keys[i], Fetched(self.store.get(keys[i].storage_key), None, 0.0, False)
            got = self.store.fetch(keys[i].storage_key)
            if not session.fetched(n, keys[i].codec, got):
                return None, None
            return keys[i], got

        sizes: dict[int, int | None] = {}  # bytes of each stored blob (None: not stored)
        decoded: dict[int, ChunkKV | None] = {}
        text: set[int] = set()  # chunks fusion recomputes from their tokens
        local: set[int] = set()  # chunks prefilled here while the next ones were fetched
        # up to 3 ahead: a run of chunks prefilled here leaves room for the read after them to start
        with contextlib.closing(prefetch(range(len(unique)), fetch, ahead=3)) as fetched:
            for n, (key, got) in enumerate(fetched):
                # the next chunks keep loading while this one decodes; its bytes are dropped after
                i = unique[n]
                if key is not None and got is None and session is not None:  # planned LOCAL
                    started = time.perf_counter()
                    decoded[i] = self.adapter.prefill_kv(segments[i], past=[self.prefix_kv()])
                    session.prefilled_here(n, len(segments[i]), time.perf_counter() - started)
                    local.add(i)
                    continue
                if key is None or got is None:
                    text.add(i)
                    if session is not None:
                        session.recomputed(n)
                    continue
                blob = got.value
                sizes[i] = None if blob is None else len(blob)
                started = time.perf_counter()
                decoded[i] = None if blob is None else self._decode(key, len(segments[i]), blob)
                if session is not None and blob is not None and decoded[i] is not None:
                    session.decoded(key.codec, len(blob), time.perf_counter() - started)
        done = self._finish_loads(segments, keys, unique, decoded, sizes, text, local)
        out = []
        for i, storage_key in enumerate(primary):
            j = first[storage_key]
            # a repeat reuses the cache its first occurrence loaded or computed: nothing to prefill,
            # nothing read (or, when its first occurrence is recomputed from text, it is too)
            out.append(done[j] if i == j else replace(done[j], hit=not done[j].recompute, nbytes=0))
        if session is not None and plan is not None:
            plan.report = session.report()
        return out

    def _session(self, segments: Sequence[Sequence[int]], plan: LoadPlanning) -> LoadSession:
        """A load session over ``segments``, with each one's stored sizes from the catalog."""
        order = self.config.stored_codecs
        keyed = [{spec: self.chunk_key(seg, spec).storage_key for spec in order} for seg in segments]
        known = self.catalog.entry_sizes([k for per in keyed for k in per.values()])
        chunks = [
            ChunkOptions(len(seg), {spec: known[k] for spec, k in per.items() if k in known})
            for seg, per in zip(segments, keyed, strict=True)
        ]
        return LoadSession(
            chunks,
            order,
            plan.estimates,
            self.store.read_estimates,
            deadline=plan.deadline,
            reserve_s=plan.reserve_s,
            fusion_ratio=plan.fusion_ratio,
            slack=plan.config.ttft_slack,
        )

    def _finish_loads(
        self,
        segments: Sequence[Sequence[int]],
        keys: list[ChunkKey],
        unique: list[int],
        decoded: dict[int, ChunkKV | None],
        sizes: dict[int, int | None],
        text: set[int],
        local: set[int],
    ) -> dict[int, LoadedChunk]:
        """Hits as loaded; text chunks as placeholders; local ones as prefilled; misses computed and
        stored; hits touched."""
        done: dict[int, LoadedChunk] = {}
        for i in unique:
            if i in text:
                done[i] = LoadedChunk(self.adapter.empty_kv(len(segments[i])), False, 0, recompute=True)
                continue
            kv = decoded[i]
            if i in local and kv is not None:
                done[i] = LoadedChunk(kv, False, 0, local=True)
                continue
            size = sizes[i]
            if kv is not None and size is not None:
                done[i] = LoadedChunk(kv, True, size)
                continue
            if size is not None:  # present but unusable: drop it everywhere, then recompute
                self.store.invalidate(keys[i].storage_key)
            kv = self.adapter.prefill_kv(segments[i], past=[self.prefix_kv()])
            done[i] = LoadedChunk(kv, False, self._put(kv, keys[i]))
        hits = [keys[i].storage_key for i in unique if done[i].hit]
        if hits:
            self.catalog.touch_entries(hits)
        return done

    def _decode(self, key: ChunkKey, num_tokens: int, blob: bytes) -> ChunkKV | None:
        """The stored cache in ``blob``, or None (with a warning) if it is not what ``key`` asks for.

        None for a damaged, truncated or unauthenticated blob, and for an intact one made for
        another key (a swapped or moved entry), model, codec, level or shape; the caller then
        invalidates the entry and recomputes the chunk.
        """
        arch = self.adapter.spec
        # Everything expected comes from the key asked for and the loaded model, never from the
        # stored bytes: a blob made for another chunk, tenant, codec or shape is refused before
        # its payload is read.
        expect = codec.Expected(
            key=key.storage_key,
            model_fingerprint=key.model_fingerprint,
            spec=key.codec,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            num_tokens=num_tokens,
            secret=self.store_secret,
        )
        try:
            return codec.decode(blob, expect=expect, device=self.adapter.device, dtype=self.adapter.dtype)
        except CodecError as e:
            logger.warning("unusable cache entry %s (%s); recomputing", key.storage_key, e)
            return None
