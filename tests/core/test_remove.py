"""RagKV.remove and ``ragkv remove``: a document's rows, vectors and (unshared) cache entries go, for one tenant."""

from __future__ import annotations

import pytest

from ragkv.codec import read_header
from ragkv.codec.transform import transform_key
from ragkv.digests import tokens_digest
from ragkv.engine import EngineConfig, RagKV
from ragkv.errors import DocumentNotFoundError
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import CodecSpec, tenant_namespace
from tests.integrations.conftest import DOCS, make_engine

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


CHUNKS = ChunkerConfig(min_tokens=40, max_tokens=120)
LEVEL1 = CodecSpec("cachegen", 1)


def _coded_engine(data_dir, adapter, retriever: RetrieverConfig) -> RagKV:
    """An engine storing chunks as ``retriever`` says (cachegen level 1: coded in the channel transform)."""
    cfg = EngineConfig(data_dir=data_dir, retriever=retriever, store=("memory://", str(data_dir / "kv")))
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def test_remove_deletes_entries_of_every_transform_and_level_the_document_was_coded_with(tmp_path, llama_adapter):
    """Indexed in transform A at levels 1 and 2, then (A lost) in a recalibrated transform B at level 1:
    removal deletes the entries of all three from every tier and the catalog, and no other document's."""
    apples, boats = DOCS[0], DOCS[1]
    first = RetrieverConfig(chunker=CHUNKS, codec=LEVEL1, index_codecs=(CodecSpec("cachegen", 2),))
    with _coded_engine(tmp_path, llama_adapter, first) as rag:
        rag.index([apples], progress=False)
        digest_a = rag.retriever.computer.transforms.digest()
        rag.store.invalidate(transform_key(rag.retriever.tenant, llama_adapter.fingerprint))  # transform A lost
    with _coded_engine(tmp_path, llama_adapter, RetrieverConfig(chunker=CHUNKS, codec=LEVEL1)) as rag:
        rag.index([boats, apples], progress=False)  # recalibrated from boats first: another transform
        digest_b = rag.retriever.computer.transforms.digest()
        assert digest_b != digest_a
        ours = {tokens_digest(c.token_ids) for c in rag.catalog.document_chunks(apples.source, "default").values()}
        entries = [e for e in rag.catalog.entries("default") if e.tokens_digest in ours]
        coded = {(e.level, read_header(rag.store.get(e.storage_key)).params.get("transform")) for e in entries}
        assert coded == {(1, digest_a), (2, digest_a), (1, digest_b)}
        others = {e.storage_key for e in rag.catalog.entries("default") if e.tokens_digest not in ours}
        report = rag.remove(apples.source)
        assert report.cache_entries == len(entries)
        assert not any(e.tokens_digest in ours for e in rag.catalog.entries("default"))
        assert {e.storage_key for e in rag.catalog.entries("default")} == others
        assert _keys(rag) >= others
    with _coded_engine(tmp_path, llama_adapter, RetrieverConfig(chunker=CHUNKS, codec=LEVEL1)) as rag:
        left = _keys(rag)  # a new process: only the disk tier holds anything now
        assert not {e.storage_key for e in entries} & left and others <= left
