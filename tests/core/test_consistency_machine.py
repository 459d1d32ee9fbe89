"""A stateful property test (issue 33): index, remove, answer, a tier refusing writes or failing
deletes, and process restarts, in any order. After every step the catalog's documents, its chunk rows,
the FAISS vectors and the stored blobs agree, and no removed document's text or cache can be found.

Each example is cheap (a tiny random-weight model, a hashing embedder, two-sentence documents); CI
runs 120 of them (`RAGKV_MACHINE_EXAMPLES` sets it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ragkv.engine import EngineConfig, RagKV
from ragkv.errors import StoreUnavailableError
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import tenant_namespace

SHARED = "Kettles whistle when the water boils."  # a chunk two documents have: one cache for both
DOCS = {
    "mem:apples": ["Apples grow on trees in orchards.", SHARED],
    "mem:boats": ["Boats float on water and carry people.", "Sails catch the wind on the lake."],
    "mem:clocks": ["Clocks measure time with gears.", SHARED],
}
EDITS = {"mem:apples": ["Apples are red or green and taste sweet.", "Pears are their cousins."]}
GEN = GenerationConfig(max_new_tokens=1)
CHUNKS = ChunkerConfig(min_tokens=8, max_tokens=48)


class Consistency(RuleBasedStateMachine):
    """The engine under test against a model of which documents are indexed."""

    adapter: Any = None  # the tiny model, set by the test (built once)

    @initialize()
    def open(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ragkv-machine-"))
        self.refusing = self.failing = False
        self.indexed: dict[str, list[str]] = {}  # source -> its paragraphs, as committed
        self.removed: set[str] = set()  # sources removed (and not indexed again since)
        self.seen: dict[str, list[tuple[int, ...]]] = {}  # source -> chunk tokens, as last indexed
        self.rag = self._engine()

    def _engine(self) -> RagKV:
        cfg = EngineConfig(
            data_dir=self.dir,
            store=("memory://", str(self.dir / "kv")),
            retriever=RetrieverConfig(top_k=2, chunker=CHUNKS),
        )
        rag = RagKV(cfg, adapter=self.adapter, embedder=HashingEmbedder(dim=32))
        disk = rag.store.tiers[1]
        put, delete = disk._put, disk._delete

        def maybe_put(key: str, value: bytes, cost: float | None) -> bool:
            return False if self.refusing else put(key, value, cost)  # a full disk, a tenant limit

        def maybe_delete(key: str) -> bool:
            if self.failing:
                raise StoreUnavailableError("read-only file system")
            return delete(key)

        disk._put, disk._delete = maybe_put, maybe_delete  # type: ignore[method-assign]
        return rag

    def teardown(self) -> None:
        self.rag.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- steps ----------------------------------------------------------------------------------

    @rule(source=st.sampled_from(sorted(DOCS)), edited=st.booleans())
    def index(self, source: str, edited: bool) -> None:
        paragraphs = EDITS.get(source, DOCS[source]) if edited else DOCS[source]
        report = self.rag.index([Document(source, "\n\n".join(paragraphs), source)], progress=False)
        if source in report.failed_documents:  # a cache not stored: not committed, the older version stays
            assert self.refusing
            # its text was offered again: this process's memory tier may keep caches of it (never recorded)
            self.seen.pop(source, None)
            return
        self.indexed[source] = paragraphs
        self.removed.discard(source)
        self.seen[source] = [c.token_ids for c in self.rag.catalog.document_chunks(source, "default").values()]

    @precondition(lambda self: self.indexed)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(sorted(self.indexed)))
        report = self.rag.remove(source)
        assert report.pending == 0 or self.failing
        del self.indexed[source]
        self.removed.add(source)

    @precondition(lambda self: self.removed)
    @rule(data=st.data())
    def retry_remove(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(sorted(self.removed)))
        if self.rag.catalog.pending_entries("default", source):
            self.rag.remove(source)

    @rule(source=st.sampled_from(sorted(DOCS)))
    def answer(self, source: str) -> None:
        """A question answered from the index (hits of live documents), then over the document's own
        paragraphs, as a request queued before its removal sends them (misses, once removed)."""
        result = self.rag.answer(DOCS[source][0], generation=GEN)
        assert not {c.source for c in result.sources} & self.removed
        for _ in self.rag.generate_stream(DOCS[source], "Which?", generation=GEN):
            pass

    @rule(on=st.booleans())
    def tier_refuses_writes(self, on: bool) -> None:
        self.refusing = on

    @rule(on=st.booleans())
    def tier_fails_deletes(self, on: bool) -> None:
        self.failing = on

    @rule()
    def restart(self) -> None:
        self.rag.close()
        self.rag = self._engine()

    # -- what must hold after every step ------------------------------------------------------------

    @invariant()
    def catalog_index_and_tiers_agree(self) -> None:
        rag, catalog = self.rag, self.rag.catalog
        assert {d.source for d in catalog.documents("default")} == set(self.indexed)
        rows = catalog.all_chunk_rows("default")
        assert sorted(rag.retriever.index.ids()) == rows
        live = {c.token_ids for c in catalog.chunks_by_rows(rows, "default")}
        codecs = rag.config.retriever.stored_codecs
        for ids in live:  # every committed chunk's cache is in the lasting tier
            assert all(rag.store.persisted(rag.retriever.computer.chunk_key(ids, s).storage_key) for s in codecs)
        pending = {e.storage_key for e in catalog.pending_entries("default")}
        for entry in catalog.entries("default"):  # a recorded entry's blob is stored (or pending deletion)
            assert entry.storage_key in pending or rag.store.tiers[1].contains(entry.storage_key)

    @invariant()
    def no_removed_document_can_be_found(self) -> None:
        rag = self.rag
        live = {c.token_ids for c in rag.catalog.chunks_by_rows(rag.catalog.all_chunk_rows("default"), "default")}
        pending = {e.storage_key for e in rag.catalog.pending_entries("default")}
        stored = set(rag.store.keys(tenant_namespace("default")))
        for source in self.removed:
            for ids in set(self.seen.get(source, ())) - live:
                for spec in rag.config.retriever.stored_codecs:
                    key = rag.retriever.computer.chunk_key(ids, spec).storage_key
                    assert key not in stored or key in pending, (source, key)
        assert {c.source for c in rag.retrieve("water trees time wind", k=8)} <= set(self.indexed)


def test_catalog_faiss_and_tiers_agree_under_any_interleaving(llama_adapter):
    Consistency.adapter = llama_adapter
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: one thread is faster, and no spinning on a busy machine
    try:
        run_state_machine_as_test(
            Consistency,
            settings=settings(
                max_examples=int(os.environ.get("RAGKV_MACHINE_EXAMPLES", "120")),
                stateful_step_count=6,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        torch.set_num_threads(threads)
