"""Nothing lost, nothing resurrected (issue 33): a document commits only with every cache in a lasting
tier; a removed document's chunks are never stored again; a removal a tier cannot finish stays pending;
a failed FAISS save commits nothing."""

from __future__ import annotations

from pathlib import Path

from ragkv.engine import EngineConfig, RagKV
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import tenant_namespace
from tests.integrations.conftest import DOCS


def engine(data_dir: Path, adapter, *store: str) -> RagKV:
    cfg = EngineConfig(
        data_dir=data_dir,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        store=store or ("memory://", str(data_dir / "kv")),
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def test_a_document_is_not_committed_when_only_the_memory_tier_took_its_caches(tmp_path, llama_adapter):
    with engine(tmp_path, llama_adapter, "memory://", f"disk://{tmp_path / 'kv'}?tenant_max_bytes=1KiB") as rag:
        report = rag.index(DOCS[:1], progress=False)
        assert report.failed >= 1 and report.failed_documents == [DOCS[0].source]
        assert report.bytes_stored == 0 and report.chunks == 0
        assert rag.catalog.documents("default") == [] and len(rag.retriever.index) == 0
        assert rag.catalog.entries("default") == []
        assert rag.store.stats()[f"disk://{tmp_path / 'kv'}"].refused >= 1
        again = rag.index(DOCS[:1], progress=False)  # the memory copies do not make it count as indexed
        assert again.unchanged == 0 and again.failed_documents == [DOCS[0].source]
    with engine(tmp_path, llama_adapter, "memory://", f"disk://{tmp_path / 'kv'}") as rag:
        report = rag.index(DOCS[:1], progress=False)  # room again: indexed in full
        assert report.failed == 0 and [d.source for d in rag.catalog.documents("default")] == [DOCS[0].source]
        keys = set(rag.store.keys(tenant_namespace("default")))
        assert all(rag.store.persisted(k) for k in keys)
