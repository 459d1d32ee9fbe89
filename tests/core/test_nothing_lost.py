"""Nothing lost, nothing resurrected (issue 33): a document commits only with every cache in a lasting
tier; a removed document's chunks are never stored again; a removal a tier cannot finish stays pending;
a failed FAISS save commits nothing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ragkv.digests import tokens_digest
from ragkv.engine import EngineConfig, RagKV
from ragkv.errors import DocumentNotFoundError, StorageWriteError, StoreUnavailableError
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import tenant_namespace
from tests.integrations.conftest import DOCS, GEN


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


def _apples(rag: RagKV, source: str = DOCS[0].source) -> tuple[list, set[str]]:
    """The apples document's chunks (as a request retrieves them) and every storage key of them."""
    chunks = list(rag.catalog.document_chunks(source, "default").values())
    keys = {rag.retriever.computer.chunk_key(c.token_ids, spec).storage_key for c in chunks for spec in
            rag.config.retriever.stored_codecs}  # fmt: skip
    return chunks, keys


def _held(rag: RagKV, keys: set[str]) -> set[str]:
    return {k for k in keys if any(tier.contains(k) for tier in rag.store.tiers)}


def test_a_request_queued_before_a_delete_does_not_bring_the_caches_back(tmp_path, llama_adapter):
    with engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS[:2], progress=False)
        chunks, keys = _apples(rag)
        assert _held(rag, keys) == keys
        rag.remove(DOCS[0].source)  # DELETE acknowledged while the request waits in the queue
        result = rag.answer("Where do apples grow?", chunks=chunks, generation=GEN)  # then it runs
        assert result.stats.prompt_tokens > 0  # answered, from recomputed caches
        assert _held(rag, keys) == set()  # ... which were not stored
        digests = {e.tokens_digest for e in rag.catalog.entries("default")}
        assert not digests & {tokens_digest(c.token_ids) for c in chunks}  # nor recorded
        rag.index(DOCS[:1], progress=False)  # indexed again: its chunks are live again
        assert _held(rag, keys) == keys


def test_an_edited_document_takes_its_old_versions_caches_with_it(tmp_path, llama_adapter):
    """Re-indexing a source with other content drops the old version's chunk caches that no document
    keeps (found by the consistency state machine: a removed document's text stayed stored)."""
    from ragkv.retriever.documents import Document

    shared = "Kettles whistle when the water boils. " * 2  # a chunk of its own in both documents
    apples = Document("mem:apples", "Apples grow on trees in orchards. " * 2 + "\n\n" + shared, "apples")
    kettles = Document("mem:kettles", "Kettles are made of steel or copper. " * 2 + "\n\n" + shared, "kettles")
    with engine(tmp_path, llama_adapter) as rag:
        rag.index([apples, kettles], progress=False)
        chunks, old_keys = _apples(rag)
        assert len(chunks) == 2
        edited = Document("mem:apples", "Apples are red or green and taste sweet. " * 2, "apples")
        rag.index([edited], progress=False)
        _, new_keys = _apples(rag)
        _, kettle_keys = _apples(rag, "mem:kettles")
        shared_keys = old_keys & kettle_keys
        assert len(shared_keys) == len(rag.config.retriever.stored_codecs)  # the shared chunk is kept
        assert _held(rag, old_keys) == shared_keys and _held(rag, new_keys) == new_keys
        recorded = {e.storage_key for e in rag.catalog.entries("default")}
        assert recorded == new_keys | kettle_keys and rag.catalog.pending_entries("default") == []
        # the old text is gone for good: a request holding the old chunks does not store it again
        rag.answer("Where do apples grow?", chunks=chunks, generation=GEN)
        assert _held(rag, old_keys) == shared_keys


def test_a_removal_between_the_check_and_the_record_erases_the_stored_cache(tmp_path, llama_adapter, monkeypatch):
    with engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS[:2], progress=False)
        chunks, keys = _apples(rag)
        rag.remove(DOCS[0].source)
        monkeypatch.setattr(rag.catalog, "is_removed", lambda tenant, digest: False)  # checked before the DELETE
        rag.answer("Where do apples grow?", chunks=chunks, generation=GEN)
        assert _held(rag, keys) == set()  # stored, then refused by the catalog, then erased
        assert not {e.tokens_digest for e in rag.catalog.entries("default")} & {
            tokens_digest(c.token_ids) for c in chunks
        }


def test_a_removal_a_tier_cannot_finish_stays_pending_until_a_retry(tmp_path, llama_adapter, monkeypatch):
    with engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS[:2], progress=False)
        chunks, keys = _apples(rag)
        disk = rag.store.tiers[1]

        def read_only(key: str) -> bool:
            raise StoreUnavailableError("read-only file system")

        monkeypatch.setattr(disk, "_delete", read_only)
        report = rag.remove(DOCS[0].source)
        assert report.pending == len(keys) and report.cache_entries == 0
        assert {e.storage_key for e in rag.catalog.pending_entries("default", DOCS[0].source)} == keys
        assert {k for k in keys if disk.contains(k)} == keys  # the blobs stayed
        assert rag.catalog.get_document(DOCS[0].source, "default") is None  # the document itself is gone
        monkeypatch.undo()
        retry = rag.remove(DOCS[0].source)  # no document, but pending entries: finished now
        assert retry.pending == 0 and retry.cache_entries == len(keys) and retry.chunks == 0
        assert _held(rag, keys) == set() and rag.catalog.pending_entries("default") == []
        with pytest.raises(DocumentNotFoundError):
            rag.remove(DOCS[0].source)


def test_a_full_disk_at_the_faiss_save_commits_nothing(tmp_path, llama_adapter, monkeypatch):
    with engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS[:1], progress=False)
        before = (rag.catalog.documents("default"), sorted(rag.retriever.index.ids()))

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("ragkv.retriever.index._atomic_write", full)
        with pytest.raises(StorageWriteError, match="No space left on device.*not committed") as caught:
            rag.index(DOCS[1:], progress=False)
        assert caught.value.errno == errno.ENOSPC
        assert (rag.catalog.documents("default"), sorted(rag.retriever.index.ids())) == before
        monkeypatch.undo()
        assert rag.index(DOCS[1:], progress=False).chunks > 0  # room again: the retry commits it
        assert len(rag.catalog.documents("default")) == len(DOCS)


def test_check_reports_and_repairs_what_disagrees(tmp_path, llama_adapter, monkeypatch):
    from ragkv.retriever.check import check

    with engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)
        assert check(rag.retriever).problems == 0
        chunks, keys = _apples(rag)
        lost = sorted(keys)[0]
        rag.store.invalidate(lost)  # a lost cache: the document is committed without it
        ghost = rag.retriever.computer.chunk_key((1, 2, 3), rag.config.retriever.codec)
        rag.catalog.record_entry(ghost.storage_key, tenant="default", tokens_digest=ghost.tokens_digest,
                                 codec="cachegen", level=0, nbytes=10, num_tokens=3)  # fmt: skip
        disk = rag.store.tiers[1]
        stuck = sorted(_apples(rag, DOCS[1].source)[1])[0]
        deleting = disk._delete

        def read_only(key: str) -> bool:  # one blob cannot go (more would open the tier's breaker)
            if key == stuck:
                raise StoreUnavailableError("read-only file system")
            return deleting(key)

        with monkeypatch.context() as patch:
            patch.setattr(disk, "_delete", read_only)
            assert rag.remove(DOCS[1].source).pending == 1
        found = check(rag.retriever)
        assert found.caches_missing and all(c.startswith(DOCS[0].source + "#") for c in found.caches_missing)
        assert sorted(found.entries_dangling) == sorted([ghost.storage_key, lost]) and found.pending == [stuck]
        fixed = check(rag.retriever, repair=True)
        assert fixed.problems == 0 and fixed.repaired >= 3
        assert rag.store.persisted(lost) and check(rag.retriever).problems == 0
