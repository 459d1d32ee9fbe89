"""Faults not yet tried (issue 33): two engines on one data directory, Redis flushed and restarted under
an engine, the PostgreSQL catalog under ``kill -9`` of the indexer."""

from __future__ import annotations

import threading
from pathlib import Path

from ragkv.engine import RagKV
from ragkv.retriever.check import check, faiss_disagreement
from ragkv.retriever.documents import Document
from tests.integrations.conftest import DOCS, make_engine

EXTRA = [
    Document("mem:drums", "Drums are struck with sticks to keep the beat. " * 10, "drums"),
    Document("mem:eagles", "Eagles hunt from high above the valley floor. " * 10, "eagles"),
]


def _faiss_path(rag: RagKV) -> Path:
    path = rag.retriever.index.path
    assert path is not None
    return path


def _agree(rag: RagKV) -> None:
    """The catalog, the FAISS file as on disk and the tiers agree (nothing for ``ragkv check`` to do)."""
    assert faiss_disagreement(rag.catalog, "default", _faiss_path(rag)) == (0, 0)
    assert check(rag.retriever).problems == 0


def _sources(rag: RagKV, question: str) -> set[str]:
    return {c.source for c in rag.retrieve(question, k=8)}


def test_two_engines_on_one_data_dir_see_each_others_documents(tmp_path, llama_adapter):
    """Each engine holds the FAISS index in memory: a commit by one must not drop the other's vectors
    from the file, and a search by one must find what the other indexed."""
    with make_engine(tmp_path, llama_adapter) as a, make_engine(tmp_path, llama_adapter) as b:
        a.index(DOCS[:1], progress=False)
        b.index(DOCS[1:2], progress=False)  # b opened before a's commit: its in-memory copy lacked apples
        a.index(DOCS[2:], progress=False)  # ... and a's lacked boats
        assert "mem:clocks" in _sources(b, "Clocks measure time")  # b finds what a indexed since
        b.remove("mem:apples")  # b's save must keep clocks' vectors, which b never added itself
        _agree(a)
        a.index(EXTRA[:1], progress=False)  # a's save must not bring apples' vectors back
        _agree(b)
        for rag in (a, b):
            assert "mem:apples" not in _sources(rag, "Apples grow on trees in orchards")
            assert _sources(rag, "Boats clocks drums") == {"mem:boats", "mem:clocks", "mem:drums"}


def test_two_engines_indexing_and_removing_at_once_agree_afterwards(tmp_path, llama_adapter):
    with make_engine(tmp_path, llama_adapter) as a, make_engine(tmp_path, llama_adapter) as b:
        a.index(DOCS, progress=False)
        errors: list[BaseException] = []

        def run(step) -> None:
            try:
                step()
            except BaseException as e:  # reported below, with the thread's traceback
                errors.append(e)

        steps = [
            lambda: [b.remove(d.source) for d in DOCS[:2]],
            lambda: a.index(EXTRA, progress=False),
        ]
        threads = [threading.Thread(target=run, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for rag in (a, b):
            _agree(rag)
            found = _sources(rag, "Apples boats clocks drums eagles")
            assert found == {"mem:clocks", "mem:drums", "mem:eagles"}
