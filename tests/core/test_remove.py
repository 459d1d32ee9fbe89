"""RagKV.remove and ``ragkv remove``: a document's rows, vectors and (unshared) cache entries go, for one tenant."""

from __future__ import annotations

import pytest

from ragkv.errors import DocumentNotFoundError
from ragkv.retriever.documents import Document
from ragkv.types import tenant_namespace
from tests.integrations.conftest import make_engine

SHARED = "Shared paragraph about tea kettles and how they whistle when the water boils. " * 4


def _keys(rag) -> set[str]:
    return set(rag.store.keys(tenant_namespace(rag.config.tenant)))


def test_remove_drops_rows_vectors_and_only_unshared_caches(tmp_path, llama_adapter):
    rag = make_engine(tmp_path, llama_adapter)
    apples = Document("mem:apples", "Apples grow on trees in orchards. " * 12, "apples")
    twin = Document("mem:twin", SHARED, "twin")
    twin2 = Document("mem:twin2", SHARED, "twin2")  # same chunk tokens: one cache entry for both
    rag.index([apples, twin, twin2], progress=False)
    before = _keys(rag)
    report = rag.remove("mem:apples")
    assert report.chunks >= 1 and report.cache_entries >= 1
    assert {d.source for d in rag.catalog.documents("default")} == {"mem:twin", "mem:twin2"}
    assert len(rag.retriever.index) == len(rag.catalog.all_chunk_rows("default"))
    assert all(c.source != "mem:apples" for c in rag.retrieve("apples orchards trees", k=4))
    after = _keys(rag)
    assert len(before - after) == report.cache_entries
    assert rag.remove("mem:twin").cache_entries == 0  # twin2 still uses the entry
    assert _keys(rag) == after
    assert rag.remove("mem:twin2").cache_entries >= 1
    with pytest.raises(DocumentNotFoundError, match="no document"):
        rag.remove("mem:twin2")
    rag.close()


def test_remove_leaves_other_tenants_alone(tmp_path, llama_adapter):
    a = make_engine(tmp_path, llama_adapter, tenant="alpha")
    b = a.for_tenant("beta")
    doc = Document("mem:same", "The same text in two tenants, about rivers and bridges. " * 6, "same")
    a.index([doc], progress=False)
    b.index([doc], progress=False)
    kept = _keys(b)
    a.remove("mem:same")
    assert _keys(b) == kept and [d.source for d in b.catalog.documents("beta")] == ["mem:same"]
    assert b.retrieve("rivers bridges", k=1)[0].source == "mem:same"
    with pytest.raises(DocumentNotFoundError):
        b.for_tenant("gamma").remove("mem:same")
    a.close()
