"""KVRetriever.index_documents and retrieve: honest writes, a catalog that heals, one copy of each chunk.

Real SQLite catalog, FAISS index and disk tier on a tiny random Llama; fault-injecting tiers only
where a store must refuse writes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ragkv.cache.catalog import Catalog
from ragkv.cache.config import TierConfig
from ragkv.cache.registry import open_tier
from ragkv.cache.store import TieredStore, open_store
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document, load_documents
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.index import FaissIndex
from ragkv.retriever.kv_retriever import IndexProgress, KVRetriever, RetrieverConfig
from ragkv.types import CodecSpec
from tests.cache.cache_testing import CLOSED_PORT_REDIS, BrokenTier

TENANT = "default"
DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 6 + "\n\nThey are red or green. " * 5, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 5 + "\n\nSails catch the wind. " * 5, "boats"),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 6, "clocks"),
]
CONFIG = RetrieverConfig(top_k=3, chunker=ChunkerConfig(min_tokens=30, max_tokens=80), codec=CodecSpec("raw", 0))

Make = Callable[..., KVRetriever]


@pytest.fixture
def make(tmp_path: Path, llama_adapter) -> Iterator[Make]:
    """``make(store=None)``: a retriever over the catalog, FAISS file and disk tier under ``tmp_path``.

    Each call opens them afresh, as a new process would.
    """
    opened: list[Catalog | TieredStore] = []

    def build(store: TieredStore | None = None) -> KVRetriever:
        catalog = Catalog(str(tmp_path / "catalog.db"))
        store = store or open_store(f"disk://{tmp_path / 'kv'}")
        opened.extend((catalog, store))
        embedder = HashingEmbedder(dim=64)
        index = FaissIndex.open(tmp_path / "chunks.faiss", embedder.dim, fingerprint=embedder.fingerprint)
        return KVRetriever(llama_adapter, store, catalog, index, embedder, CONFIG, tenant=TENANT)

    yield build
    for thing in opened:
        thing.close()


def _sql(retriever: KVRetriever, statement: str, *args: object) -> None:
    """Damage the catalog by hand, as the sqlite3 shell does (foreign keys off)."""
    path = retriever.catalog.url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path)
    conn.execute(statement, args)
    conn.commit()
    conn.close()


def _consistent(retriever: KVRetriever) -> list[int]:
    """The catalog's chunk rows, checked to be exactly the FAISS index's ids."""
    rows = retriever.catalog.all_chunk_rows(TENANT)
    assert sorted(retriever.index.ids()) == rows
    return rows


def _chunk_counts(retriever: KVRetriever) -> dict[str, int]:
    counts: dict[str, int] = {}
    for chunk in retriever.catalog.chunks_by_rows(retriever.catalog.all_chunk_rows(TENANT), TENANT):
        counts[chunk.source] = counts.get(chunk.source, 0) + 1
    return counts


@pytest.mark.parametrize("down", ["broken", "closed-port-redis"])
def test_a_store_that_accepts_nothing_records_nothing(make: Make, tmp_path: Path, down: str) -> None:
    """Indexing with the only tier down used to report success and write catalog rows."""
    tier = BrokenTier(TierConfig.from_url("memory://")) if down == "broken" else open_tier(CLOSED_PORT_REDIS)
    retriever = make(TieredStore([tier]))
    report = retriever.index_documents(DOCS, progress=False)
    assert report.failed > 0 and report.failed == report.computed
    assert report.bytes_stored == 0 and report.chunks == 0
    assert report.failed_documents == [d.source for d in DOCS]
    assert retriever.catalog.documents(TENANT) == []
    assert retriever.catalog.all_chunk_rows(TENANT) == []
    assert retriever.catalog.entries(TENANT) == []
    assert len(retriever.index) == 0 and not (tmp_path / "chunks.faiss").exists()

    retriever = make()  # the tier is back: the next run indexes everything
    report = retriever.index_documents(DOCS, progress=False)
    assert (report.failed, report.failed_documents, report.unchanged) == (0, [], 0)
    assert report.chunks > 0 and report.bytes_stored > 0
    assert len(retriever.catalog.entries(TENANT)) == report.computed
    assert len(_consistent(retriever)) == report.chunks
    assert retriever.retrieve("boats and sails", k=1)[0].source == "mem:boats"


def test_deleted_chunk_rows_heal_on_reindex(make: Make) -> None:
    """After its chunk rows were deleted, re-indexing a document used to say 'unchanged' for good."""
    retriever = make()
    first = retriever.index_documents(DOCS, progress=False)
    counts = _chunk_counts(retriever)
    _sql(retriever, "DELETE FROM ragkv_chunks WHERE source = ?", "mem:boats")
    for again in (retriever, make()):  # this process, and a new one (which reconciles FAISS first)
        _sql(again, "DELETE FROM ragkv_chunks WHERE source = ?", "mem:boats")
        report = again.index_documents(DOCS, progress=False)
        assert report.unchanged == 2 and report.chunks == counts["mem:boats"]
        assert report.computed == 0 and report.reused == counts["mem:boats"]  # the caches were still stored
        assert _chunk_counts(again) == counts
        assert len(_consistent(again)) == first.chunks
        assert again.retrieve("boats float on water", k=1)[0].source == "mem:boats"


def test_a_deleted_document_row_does_not_duplicate_its_chunks(make: Make) -> None:
    retriever = make()
    retriever.index_documents(DOCS, progress=False)
    counts = _chunk_counts(retriever)
    _sql(retriever, "DELETE FROM ragkv_documents WHERE source = ?", "mem:clocks")  # its chunks stay behind
    report = retriever.index_documents(DOCS, progress=False)
    assert report.unchanged == 2 and report.computed == 0
    assert _chunk_counts(retriever) == counts
    _consistent(retriever)
    texts = [c.text for c in retriever.retrieve("clocks gears springs", k=len(retriever.index))]
    assert len(texts) == len(set(texts))


def test_a_lost_cache_entry_is_stored_again_on_reindex(make: Make) -> None:
    retriever = make()
    retriever.index_documents(DOCS, progress=False)
    [chunk] = retriever.retrieve("clocks", k=1)
    key = retriever.computer.chunk_key(chunk.token_ids, CONFIG.codec).storage_key
    assert retriever.store.invalidate(key)
    report = retriever.index_documents(DOCS, progress=False)
    assert report.unchanged == 2 and report.computed == 1
    assert retriever.store.contains(key)
    again = retriever.index_documents(DOCS, progress=False)
    assert again.unchanged == 3 and again.computed == 0 and again.chunks == 0


def test_three_spellings_of_one_corpus_are_one_set_of_documents(
    make: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for doc in DOCS:
        (corpus / f"{doc.title}.txt").write_text(doc.text)
    monkeypatch.chdir(tmp_path)
    retriever = make()
    reports = [
        retriever.index_documents(load_documents([p]), progress=False)
        for p in ("corpus/", "./corpus/", f"{corpus.resolve()}/")
    ]
    assert [r.unchanged for r in reports] == [0, 3, 3]
    assert len(retriever.catalog.documents(TENANT)) == 3
    rows = _consistent(retriever)
    found = retriever.retrieve("apples grow on trees", k=len(rows))
    assert len(found) == len({c.chunk_id for c in found}) == len({c.text for c in found})


def test_retrieval_returns_distinct_chunks_from_an_old_catalog_with_copies(make: Make) -> None:
    """An older ragkv indexed `corpus/a.txt` and `./corpus/a.txt` as two documents: k hits were one chunk k times."""
    retriever = make()
    text = DOCS[0].text
    copies = [Document(source, text, "apples") for source in ("corpus/a.txt", "./corpus/a.txt", "/abs/corpus/a.txt")]
    retriever.index_documents(copies, progress=False)
    assert len(retriever.catalog.documents(TENANT)) == 3
    found = retriever.retrieve("apples grow on trees in orchards", k=3)
    assert len(found) == 3
    assert len({c.text for c in found}) == 3
    assert [c.score for c in found] == sorted((c.score for c in found), reverse=True)  # type: ignore[arg-type]


def test_a_user_given_source_is_stripped_and_must_not_be_empty(make: Make) -> None:
    retriever = make()
    retriever.index_documents([Document("  wiki:Apples\n", DOCS[0].text, "apples")], progress=False)
    assert retriever.index_documents([Document("wiki:Apples", DOCS[0].text, "apples")], progress=False).unchanged == 1
    assert [d.source for d in retriever.catalog.documents(TENANT)] == ["wiki:Apples"]
    with pytest.raises(ValueError, match="empty source"):
        retriever.index_documents([Document(" ", "text", "untitled")], progress=False)


def test_progress_counts_every_phase_to_its_total(make: Make):
    retriever = make()
    events: list[IndexProgress] = []
    report = retriever.index_documents(DOCS, progress=False, on_progress=events.append)
    phases = {p: [(e.done, e.total) for e in events if e.phase == p] for p in ("chunking", "precompute", "embedding")}
    assert phases["chunking"] == [(i, len(DOCS)) for i in range(1, len(DOCS) + 1)]
    assert phases["precompute"] == [(i, report.computed) for i in range(report.computed + 1)]
    assert phases["embedding"] == [(i, len(DOCS)) for i in range(1, len(DOCS) + 1)]
    kinds = [e.phase for e in events]
    assert kinds.index("embedding") > kinds.index("precompute") + 1  # a document commits after its chunks' caches

    events.clear()
    again = retriever.index_documents(DOCS, progress=False, on_progress=events.append)
    assert again.unchanged == len(DOCS) and events == []  # nothing to do, nothing to report
