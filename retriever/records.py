"""The retriever's settings and what an indexing run reports (``RetrieverConfig``, ``IndexReport``, ...).

Kept apart from :mod:`ragkv.retriever.kv_retriever` (which re-exports them) so the engine and the
server can name them without the indexer's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ragkv.digests import Digest
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.transforms import TransformConfig
from ragkv.types import DEFAULT_CODEC, Chunk, CodecSpec

__all__ = ["IndexPlan", "IndexProgress", "IndexReport", "ProgressFn", "RemoveReport", "RetrieverConfig"]


@dataclass(frozen=True, slots=True)
class RetrieverConfig:
    """Indexing and retrieval settings (the tenant and the store secret are the caller's identity,
    passed to :class:`KVRetriever` on their own)."""

    top_k: int = 4  # chunks retrieved per question
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    codec: CodecSpec = DEFAULT_CODEC  # codec and level chunks are stored and loaded at
    index_codecs: tuple[CodecSpec, ...] = ()  # further (codec, level) pairs stored at index time
    system: str | None = None  # system prompt (None = ragkv.prompt.DEFAULT_SYSTEM)
    # stored levels coded in the model's channel transform (default: cachegen levels 1 and 2; see
    # docs/configuration.md); TransformConfig(levels=()) turns it off
    transform: TransformConfig = field(default_factory=TransformConfig)
    # threads that decode a request's chunk caches side by side (None: half the cores, 1 to 8, for
    # a model on a GPU, 1 on the CPU; 1: one after another on the query thread; ragkv.retriever.decoding)
    decode_workers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1 (chunks retrieved per question); got {self.top_k!r}")
        if not isinstance(self.codec, CodecSpec) or not all(isinstance(c, CodecSpec) for c in self.index_codecs):
            raise TypeError("codec and index_codecs take CodecSpec records, e.g. CodecSpec('cachegen', 0)")
        if not isinstance(self.transform, TransformConfig):
            raise TypeError("transform takes a TransformConfig, e.g. TransformConfig(levels=()) for off")
        w = self.decode_workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"decode_workers must be an integer >= 1 (threads), or None for the default; got {w!r}")

    @property
    def stored_codecs(self) -> tuple[CodecSpec, ...]:
        """Every (codec, level) written at index time: ``codec`` first, then ``index_codecs``."""
        return tuple(dict.fromkeys((self.codec, *self.index_codecs)))


@dataclass(frozen=True, slots=True)
class RemoveReport:
    """What :meth:`KVRetriever.remove_document` (``RagKV.remove``) deleted."""

    source: str  # the document's source, as the catalog holds it
    chunks: int  # chunk rows (and FAISS vectors) removed
    cache_entries: int  # stored cache entries deleted (those no other document of the tenant uses)
    pending: int = 0  # entries a tier could not delete (read-only, down): kept in the catalog; retry


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
    ready: list[tuple[Document, Digest, list[Chunk]]] = field(default_factory=list)  # complete, not committed yet
    replacing: set[str] = field(default_factory=set)  # sources of ``documents`` indexed before (another version)

    def __post_init__(self) -> None:
        self.scheduled = set(self.work)
