"""RagKV: the facade a user holds. It builds the parts and delegates to them.

The parts: the model adapter, the store and catalog, the tenant's indexer (``KVRetriever``),
the prefill path (``ragkv.answering.AnswerPath``: fused or full, whole or in pieces) and the
tenant's prompt registry (``ragkv.matching.TenantChunks``); settings are
``ragkv.config.EngineConfig``. Every answer runs through the answer driver (``ragkv.driver``):
here in the caller's thread, a batch of one; in the server, batched with the other requests.

Threads: one ``RagKV`` may be shared by several threads. Retrieval, store reads and writes, codec
decoding and text streaming run concurrently; work on the model (fused prefill, full prefill, each
decode step) is serialized by one lock, so concurrent answers interleave token by token; indexing
and retrieval share a lock on the FAISS index. Each answer is exactly what it would be alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ragkv.answering import AnswerPath, AnswerStream, Prefilled, Riders
from ragkv.config import EngineConfig, default_data_dir
from ragkv.driver import JobRequest, answer_inline
from ragkv.fusion import FusionConfig, PieceBudget, Pieces, drain
from ragkv.generation import GenerationConfig
from ragkv.gpu.host_tier import HostTier, HostTierConfig
from ragkv.gpu.tier import DeviceTier, DeviceTierConfig
from ragkv.matching import ChunkRegistry, TenantChunks
from ragkv.model import ModelAdapter, load_model
from ragkv.model.attention import DecodeWeights
from ragkv.model.placement import resolve_decode_weights
from ragkv.model.quant import time_formats
from ragkv.planner.ratebook import RateBook
from ragkv.planner.session import LoadEstimates
from ragkv.prompt import render_chat, render_completion
from ragkv.retriever.kv_retriever import IndexReport, KVRetriever, ProgressFn, RemoveReport
from ragkv.retriever.ray_index import RayConfig
from ragkv.types import (
    CachedText,
    Chunk,
    GenerationResult,
    GenerationStats,
    tenant_namespace,
    validate_tenant,
)

if TYPE_CHECKING:
    from ragkv.cache.catalog import DocumentRecord
    from ragkv.cache.tier import TierStats

logger = logging.getLogger(__name__)

__all__ = ["AnswerStream", "CachedText", "EngineConfig", "Prefilled", "RagKV", "RemoveReport", "default_data_dir"]


class RagKV:
    """Index documents once; answer questions reusing their chunk caches.

    Args:
        config: engine settings (defaults: SQLite catalog, memory + disk store, FAISS, SmolLM2).
        adapter: an already loaded model (skips loading ``config.model``).
        embedder: an embedder object (skips loading ``config.embedder``).
        share: another engine whose model, embedder, store, catalog, model lock and measured
            speeds this one uses (another tenant's engine: :meth:`for_tenant`); ``adapter`` and
            ``embedder`` are then ignored, and :meth:`close` closes nothing.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        adapter: ModelAdapter | None = None,
        embedder: Any = None,
        share: RagKV | None = None,
    ) -> None:
        from ragkv.cache.catalog import Catalog
        from ragkv.cache.store import open_store
        from ragkv.retriever.embedder import SentenceTransformerEmbedder

        self.config = config or EngineConfig()
        self._index_lock = threading.RLock()  # indexing vs retrieval on the FAISS index
        self._owner = share is None  # closes the store, catalog and rate book it opened
        if share is None:
            self.load_estimates = LoadEstimates(self.config.load)  # prefill and decode speeds, measured as it runs
            self._model_lock = threading.RLock()  # one forward pass at a time (see the module docstring)
            data_dir = self.config.data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            self.adapter = adapter or load_model(
                self.config.model, device=self.config.device, dtype=self.config.dtype, offline=self.config.offline
            )
            self.embedder = embedder or SentenceTransformerEmbedder(self.config.embedder)
            self.store = open_store(self.config.store_urls())
            self._rate_book = RateBook(
                data_dir / "load_rates.json" if self.config.load.persist else None,
                self.store,
                self.load_estimates,
                model=f"{self.adapter.name}@{self.adapter.device}",
            )
            self._rate_book.load()  # the speeds an earlier process measured: no guessing on a cold start
            self.catalog = Catalog(self.config.catalog_url())
            # the weights decode steps read; an int8/int4/fp16 copy is made now (a bad format or device raises here)
            adapter = self.adapter
            weights, why = resolve_decode_weights(
                self.config.decode_weights,
                adapter.device,
                adapter.weight_bits,
                timer=lambda formats: time_formats(adapter.model, formats),
            )
            self.decode_weights: DecodeWeights = weights  # type: ignore[assignment]
            self.decode_weights_reason = why
            self.adapter.model_for(self.decode_weights)
            logger.info("decode steps read the %s weights (%s)", self.decode_weights, why)
            self.device_tier = _device_tier(self.config.device_tier, self.adapter)  # every tenant's, one per process
            self.host_tier = _host_tier(self.config.host_tier, self.adapter)  # behind it, in pinned host memory
        else:  # another tenant's engine: the model, embedder, stores and speeds are share's
            self.load_estimates, self._model_lock = share.load_estimates, share._model_lock
            self.adapter, self.embedder, self.decode_weights = share.adapter, share.embedder, share.decode_weights
            self.decode_weights_reason = share.decode_weights_reason
            self.store, self.catalog, self._rate_book = share.store, share.catalog, share._rate_book
            self.device_tier, self.host_tier = share.device_tier, share.host_tier
        self.retriever = self._retriever(self.config.tenant)
        self.answers = AnswerPath(self)  # prefill, fused or full (ragkv/answering.py)
        self._chunks = TenantChunks(self.catalog, self.config.tenant)  # the prompt matcher's registry

    def chunk_registry(self, *, refresh: bool = False) -> ChunkRegistry:
        """The chunk texts this engine finds inside whole prompts, for the server and the integrations.

        Its tenant's indexed chunks (pinned: never forgotten while indexed) plus the texts
        frameworks register (``registry.add``; the least recent forgotten past its capacity). The
        catalog is looked at most every ``ragkv.matching.REGISTRY_SYNC_S`` seconds, or now with
        ``refresh=True`` (after documents were added or removed). See ``ragkv.matching.TenantChunks``.
        """
        return self._chunks.current(refresh=refresh)

    def _retriever(self, tenant: str) -> KVRetriever:
        """``tenant``'s retriever over this engine's model, embedder, store and catalog."""
        from ragkv.retriever.index import FaissIndex

        # one FAISS file per tenant: a tenant's search never sees another's chunks
        path = self.config.data_dir / f"chunks-{tenant_namespace(tenant)}.faiss"
        index = FaissIndex.open(path, self.embedder.dim, fingerprint=self.embedder.fingerprint)
        return KVRetriever(
            self.adapter,
            self.store,
            self.catalog,
            index,
            self.embedder,
            self.config.retriever,
            tenant=tenant,
            store_secret=self.config.store_secret,
            device_tier=self.device_tier,
            host_tier=self.host_tier,
        )

    # ---- indexing ---------------------------------------------------------------------------
    def index(
        self,
        paths_or_documents: Sequence[Any],
        *,
        progress: bool = True,
        executor: str = "local",
        ray: RayConfig | None = None,
        on_progress: ProgressFn | None = None,
    ) -> IndexReport:
        """Index files, directories or ``Document`` objects.

        Args:
            paths_or_documents: files, directories or ``Document`` objects.
            progress: show a progress bar over the chunks to prefill.
            executor: ``"local"`` prefills in this process; ``"ray"`` in Ray actors that load
                ``config.model`` once each and write to the configured store (needs ``ragkv[ray]``
                and a store the workers share); planning and committing stay here.
            ray: Ray settings (address, actors, retries); None = ``RayConfig()``.
            on_progress: hears each step of chunking, precompute and embedding
                (``ragkv.retriever.kv_retriever.IndexProgress``), on the calling thread.

        Returns:
            What the run did; ``report.failed`` counts chunk caches that were not stored
            (their documents are not recorded, so the next run retries them).
        """
        if executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
        from ragkv.retriever.documents import Document, load_documents

        docs = [d for d in paths_or_documents if isinstance(d, Document)]
        paths = [p for p in paths_or_documents if not isinstance(p, Document)]
        if paths:
            docs += load_documents(paths)
        if not docs:
            raise ValueError("nothing to index: pass files, directories or Document objects")
        compute = None
        if executor == "ray":
            from ragkv.retriever.ray_index import WorkerSpec, check_store_reach, ray_compute

            threads = 1 if ray is None else ray.cpus_per_actor
            spec = WorkerSpec.for_retriever(self.retriever, self.config.model, self.config.store_urls(), threads)
            check_store_reach(spec.store, nodes=1)  # before any work; the cluster's size is checked once connected
            compute = ray_compute(spec, ray)
        with self._index_lock:
            return self.retriever.index_documents(docs, progress=progress, compute=compute, on_progress=on_progress)

    def retrieve(self, question: str, k: int | None = None) -> list[Chunk]:
        """The top-``k`` chunks for ``question`` (default ``config.retriever.top_k``), best first."""
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be an integer >= 1 (chunks to retrieve); got {k!r}")
        with self._index_lock:
            return self.retriever.retrieve(question, k)

    # ---- answering ----------------------------------------------------------------------------
    def answer(
        self,
        question: str,
        *,
        mode: str = "reuse",
        chunks: Sequence[Chunk] | None = None,
        generation: GenerationConfig | None = None,
        fusion: FusionConfig | None = None,
    ) -> GenerationResult:
        """Retrieve (unless ``chunks`` are given) and answer ``question``.

        ``mode="reuse"`` loads and fuses chunk caches; ``mode="full"`` prefills the same prompt from
        scratch (the reference).
        """
        stream = self.stream(question, mode=mode, chunks=chunks, generation=generation, fusion=fusion)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        question: str,
        *,
        mode: str = "reuse",
        chunks: Sequence[Chunk] | None = None,
        generation: GenerationConfig | None = None,
        fusion: FusionConfig | None = None,
    ) -> AnswerStream:
        """Like :meth:`answer`, yielding text as it is generated; ``.result`` holds the final result."""
        if mode not in ("reuse", "full"):
            raise ValueError(f"mode must be 'reuse' or 'full', got {mode!r}")
        t0 = time.perf_counter()
        warning = None
        if chunks is None:
            chunks = self.retrieve(question)
            if not chunks:
                warning = (
                    f"the index of tenant {self.config.tenant!r} in {self.config.data_dir} is empty: answering "
                    "without sources; index documents first (ragkv index PATH, or RagKV.index)"
                )
                logger.warning(warning)
        retrieval_ms = (time.perf_counter() - t0) * 1000
        texts = [c.text for c in chunks]
        inner = self.generate_stream(texts, question, mode=mode, generation=generation, fusion=fusion)
        return AnswerStream(inner, sources=tuple(chunks), retrieval_ms=retrieval_ms, warning=warning)

    def generate_stream(
        self,
        chunk_texts: Sequence[str],
        question: str,
        *,
        mode: str = "reuse",
        generation: GenerationConfig | None = None,
        fusion: FusionConfig | None = None,
    ) -> Iterator[tuple[str, GenerationStats | None]]:
        """Answer ``question`` over the given chunk texts in ragkv's prompt layout.

        Yields ``(delta, None)`` per piece of answer text, then ``("", stats)``. Chunks found in the
        store are loaded; unknown ones are computed now and stored for next time.
        """
        request = JobRequest(
            self, generation or self.config.generation, mode, rag=(chunk_texts, question), fusion=fusion
        )
        return self._answer(request)

    def generate_segments(
        self,
        segments: Sequence[str | CachedText],
        *,
        generation: GenerationConfig | None = None,
        fusion: FusionConfig | None = None,
    ) -> Iterator[tuple[str, GenerationStats | None]]:
        """Generate from a whole prompt given as segments (what the framework integrations call).

        The prompt is the concatenation of ``segments`` (chat special tokens included). Plain
        strings are prefilled; ``CachedText`` segments reuse (or compute and store) the cache of
        exactly that text. Each segment is tokenized on its own. With no ``CachedText`` this is a
        plain prefill of the whole prompt, exactly like the model alone.
        """
        request = JobRequest(self, generation or self.config.generation, segments=segments, fusion=fusion)
        return self._answer(request)

    def _answer(self, request: JobRequest) -> Iterator[tuple[str, GenerationStats | None]]:
        """``request`` through the answer driver in this thread (``ragkv.driver.answer_inline``):
        ``(delta, None)`` per piece of text, then ``("", stats)``."""
        for event in answer_inline(request, self.adapter, self.decode_weights):
            yield event.text, event.stats

    def warm(self, chunk_texts: Sequence[str]) -> int:
        """Make sure the cache of each text (tokenized on its own) is stored; return how many were computed."""
        computed = 0
        for text in chunk_texts:
            ids = self.adapter.encode(text)
            if ids:
                with self._model_lock:
                    computed += self.retriever.ensure(ids)
        return computed

    # ---- what the front ends read (integrations/, ragkv/server/, ragkv/cli/) -----------------
    # Front ends ask the engine, not its parts: the adapter, store and catalog stay its business.
    @property
    def model_name(self) -> str:
        """The loaded model's name (the alias, path, file or hub id it was loaded from)."""
        return str(self.adapter.name)

    @property
    def max_context(self) -> int:
        """The most tokens (prompt and answer) the model takes."""
        return int(self.adapter.spec.max_context)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (else chats render as a ``role: content`` transcript)."""
        return bool(getattr(self.adapter.tokenizer, "chat_template", None))

    def model_info(self) -> dict[str, str]:
        """What every figure this engine gives is computed with: model, dtype (and why), decode weights."""
        from ragkv.model.placement import dtype_name

        return {
            "model": self.model_name,
            "dtype": dtype_name(self.adapter.dtype),
            "dtype_reason": str(self.adapter.dtype_reason),
            "decode_weights": str(self.decode_weights),
            "decode_weights_reason": self.decode_weights_reason,
        }

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids in the model's tokenizer (no special tokens added)."""
        return list(self.adapter.encode(text))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt of ``messages`` (``{"role", "content"}`` dicts) in the model's chat template."""
        return render_chat(self.adapter.tokenizer, messages)

    def render_completion(self, prompt: str, *, chat_template: bool) -> str:
        """``prompt`` as one user turn of the chat template (``chat_template``), or as is."""
        return render_completion(self.adapter.tokenizer, prompt, chat_template=chat_template)

    def documents(self) -> list[DocumentRecord]:
        """This tenant's indexed documents, by source."""
        return self.catalog.documents(self.config.tenant)

    def chunk_texts(self) -> list[str]:
        """The text of every chunk this tenant has indexed."""
        cat, tenant = self.catalog, self.config.tenant
        return [c.text for c in cat.chunks_by_rows(cat.all_chunk_rows(tenant), tenant)]

    def stored_bytes(self) -> int | None:
        """The most value bytes any store tier holds for this tenant (None: no tier can tell cheaply)."""
        known = [u[1] for u in self.store.usage(tenant_namespace(self.config.tenant)).values() if u is not None]
        return max(known) if known else None

    def tier_health(self) -> dict[str, str]:
        """Each store tier's circuit state by tier name: "closed" (in use), "open" (skipped), "half-open"."""
        return self.store.health()

    def tier_stats(self) -> dict[str, TierStats]:
        """Each store tier's hit, miss and error counters by tier name."""
        return self.store.stats()

    # ---- serving: shared model, prefill without decoding, removal ---------------------------
    @property
    def model_lock(self) -> threading.RLock:
        """Held for every forward pass on the model (shared by every tenant's engine of this model)."""
        return self._model_lock

    def save_rates_soon(self) -> None:
        """Persist the measured speeds soon (the answer path calls it after each prefill)."""
        self._rate_book.save_soon()

    def for_tenant(self, tenant: str) -> RagKV:
        """An engine for ``tenant`` sharing this one's model, embedder, store, catalog and model lock.

        Its documents, chunks, FAISS file and cache entries are ``tenant``'s own; closing it closes
        nothing shared (close this engine for that).
        """
        from dataclasses import replace

        return RagKV(replace(self.config, tenant=validate_tenant(tenant)), share=self)

    def prefill(
        self,
        segments: Sequence[str | CachedText] | None = None,
        *,
        rag: tuple[Sequence[str], str] | None = None,
        mode: str = "reuse",
        max_new_tokens: int = 0,
        fusion: FusionConfig | None = None,
    ) -> Prefilled:
        """The prompt's cache and last logits, ready for decoding (what a batching scheduler calls).

        The prompt is either ``segments`` (as :meth:`generate_segments`) or ``rag=(chunk_texts,
        question)`` (ragkv's own layout, as :meth:`generate_stream`). ``mode="full"`` prefills it
        from scratch. Raises ``ContextTooLongError`` when prompt plus ``max_new_tokens`` do not fit.
        """
        return drain(self.prefill_steps(segments, rag=rag, mode=mode, max_new_tokens=max_new_tokens, fusion=fusion))

    def prefill_steps(
        self,
        segments: Sequence[str | CachedText] | None = None,
        *,
        rag: tuple[Sequence[str], str] | None = None,
        mode: str = "reuse",
        max_new_tokens: int = 0,
        fusion: FusionConfig | None = None,
        step_tokens: int | PieceBudget | None = None,
        riders: Riders | None = None,
    ) -> Pieces[Prefilled]:
        """:meth:`prefill` in pieces of about ``step_tokens`` tokens of work, for a server that decodes
        between them (chunked prefill, as Sarathi-Serve does).

        Each ``next()`` runs one piece under the model lock; the generator's return value is the
        :class:`Prefilled`. A full prefill runs ``step_tokens`` prompt tokens per piece (the last
        piece computes the logits); a fused prefill pauses its recompute pass between layers
        (``ragkv.fusion.fuse_steps``; loading the chunk caches is its first piece). ``None``: one
        piece. The result equals :meth:`prefill`'s (within the dtype's rounding: a chunk's queries
        attend over the cache written so far instead of one causal pass). Bad arguments raise at
        the first ``next()``. ``riders``: asked before each piece for a decode step that may ride
        on its forward pass (``AnswerPath.prefill_steps``).
        """
        if (segments is None) == (rag is None):
            raise ValueError("pass either segments or rag=(chunk_texts, question)")
        if rag is not None:
            prompt = self.answers.rag_prompt(*rag)
        else:
            prompt = self.answers.segments_prompt(segments or [])
            mode = mode if prompt.middle else "full"
        return (
            yield from self.answers.prefill_steps(
                prompt,
                mode=mode,
                max_new_tokens=max_new_tokens,
                fusion=fusion,
                step_tokens=step_tokens,
                riders=riders,
            )
        )

    def remove(self, source: str) -> RemoveReport:
        """Forget document ``source`` of this tenant: catalog rows, FAISS entries and its stored caches.

        A cache entry goes only when no other document of the tenant still has a chunk with the same
        tokens (entries are keyed by content, so two documents may share one).
        """
        with self._index_lock:
            return self.retriever.remove_document(source)

    def sync_index(self) -> None:
        """Bring this tenant's FAISS file level with the shared catalog (the source of truth).

        A server replica calls it on a period: documents another machine indexed (into its own FAISS
        file) become retrievable here, and vectors of documents removed elsewhere go. Retrieval is
        right without it for removals (every hit is looked up in the catalog, and a removed
        document's rows are gone), so this bounds only how soon a new document is found.
        """
        with self._index_lock:
            self.retriever.sync_index()

    def close(self) -> None:
        """Save the measured speeds and close the store and catalog (a tenant's engine from
        :meth:`for_tenant` closes nothing: they belong to the engine it shares them with)."""
        if not self._owner:
            return
        self._rate_book.save()
        self.store.close()
        self.catalog.close()

    def __enter__(self) -> RagKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_tier(config: DeviceTierConfig, adapter: ModelAdapter) -> DeviceTier | None:
    """The device tier for ``adapter``'s device (None when its budget is 0: a CPU model by default)."""
    budget = config.budget_for(adapter.device)
    if budget <= 0:
        return None
    logger.info("device tier on %s: up to %.1f GiB of decoded chunk caches", adapter.device, budget / 2**30)
    return DeviceTier(budget, adapter.device)


def _host_tier(config: HostTierConfig, adapter: ModelAdapter) -> HostTier | None:
    """The host tier behind the device tier (None when its budget is 0: a CPU model by default)."""
    budget = config.budget_for(adapter.device)
    if budget <= 0:
        return None
    tier = HostTier(budget, queue_size=config.queue_size)
    memory = "pinned" if tier.pin else "pageable"
    logger.info("host tier: up to %.1f GiB of decoded chunk caches in %s host memory", budget / 2**30, memory)
    return tier
