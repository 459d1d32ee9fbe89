"""The vLLM KV connector: its decisions without vLLM (CI), and the connector inside vLLM (its own venv).

The first part runs everywhere: chunk spans found in token ids, the span reported, slot
mapping, and ragkv's side of the connector on the tiny model (misses on bad entries, fused K/V
against a plain prefill). The second part needs vLLM, which lives in its own virtual environment
(its pins clash with the main one's); it is skipped elsewhere. ``make test-vllm`` (CI runs it)
builds that venv with ``tools/vllm_env.sh`` and runs this file there with ``RAGKV_REQUIRE_VLLM=1``,
which turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ragkv.cache.store import open_store
from ragkv.fusion import FusionConfig
from ragkv.integrations._vllm_core import (
    ChunkSpan,
    ChunkTokenIndex,
    KnownChunk,
    RagkvSide,
    ServePlan,
    choose_span,
    slot_mapping,
)
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.retriever.precompute import ChunkComputer
from ragkv.types import CodecSpec

CHUNK_A = "Apples grow on trees in orchards across the valley, and the harvest comes in late autumn each year."
CHUNK_B = "Boats float on the water of the bay and carry people and their goods between the small islands."
GAP = "And also: "


# ---- chunk spans in token ids -------------------------------------------------------------------
def test_chunk_found_by_its_core_when_the_prompt_tokenizes_the_separator_differently():
    index = ChunkTokenIndex(min_tokens=4)
    index.add([10, 11, 12, 13, 14, 1116], [10, 11, 12, 13, 14])  # stored: text + one "\n\n" token
    spans = index.find([1, 2, 10, 11, 12, 13, 14, 198, 198, 7])  # the prompt wrote "\n", "\n"
    assert [(s.start, s.end, s.chunk.core) for s in spans] == [(2, 7, 5)]
    assert spans[0].chunk.stored_ids == (10, 11, 12, 13, 14, 1116)  # the key is still over the stored ids


def test_whole_stored_form_claims_before_the_core():
    index = ChunkTokenIndex(min_tokens=4)
    index.add([10, 11, 12, 13, 14, 1116], [10, 11, 12, 13, 14])
    spans = index.find([10, 11, 12, 13, 14, 1116, 9])
    assert [(s.start, s.end) for s in spans] == [(0, 6)]


def test_spans_do_not_overlap_and_longest_chunk_wins():
    index = ChunkTokenIndex(min_tokens=4)
    index.add([1, 2, 3, 4], [1, 2, 3, 4])
    index.add([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    index.add([5, 6, 7, 8], [5, 6, 7, 8])
    spans = index.find([0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4])
    assert [(s.start, s.end) for s in spans] == [(1, 7), (9, 13)]


def test_short_chunks_and_non_prefix_cores_are_left_alone():
    index = ChunkTokenIndex(min_tokens=6)
    index.add([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])  # too short: never matched
    index.add([7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 11, 99])  # core is not a prefix: whole form only
    assert index.find([1, 2, 3, 4, 5, 0]) == []
    assert index.find([7, 8, 9, 10, 11, 12, 0]) == []
    assert [(s.start, s.end) for s in index.find([0, 7, 8, 9, 10, 11, 12, 13])] == [(1, 8)]


# ---- the span reported -------------------------------------------------------------------------
def _span(start: int, end: int) -> ChunkSpan:
    return ChunkSpan(start, end, KnownChunk(tuple(range(start, end)), end - start))


def test_span_ends_at_the_last_chunk_below_the_prompt_end():
    # the last partial block is served too: vLLM computes the rest of it
    plan = choose_span([_span(5, 40), _span(45, 70)], 80, 0, 16, lambda c: True)
    assert plan is not None
    assert (plan.start, plan.end, plan.context_end, plan.new_tokens) == (0, 70, 70, 70)
    # a prompt ending right after the chunk: vLLM keeps at least one token to compute
    plan = choose_span([_span(0, 64)], 64, 0, 16, lambda c: True)
    assert plan is not None and plan.end == 63


def test_span_stops_at_the_first_chunk_the_store_cannot_serve():
    bad = _span(45, 70)
    plan = choose_span([_span(5, 40), bad, _span(72, 100)], 120, 0, 16, lambda c: c is not bad.chunk)
    assert plan is not None and (plan.end, plan.context_end, len(plan.spans)) == (40, 40, 1)
    assert choose_span([bad], 120, 0, 16, lambda c: c is not bad.chunk) is None


def test_span_starts_at_vllms_own_hit_and_is_none_when_the_hit_covers_it():
    plan = choose_span([_span(5, 70)], 80, 32, 16, lambda c: True)
    assert plan is not None and (plan.start, plan.new_tokens) == (32, 38)
    # less than a block beyond vLLM's own hit: not worth a fusion of the whole context
    assert choose_span([_span(5, 70)], 80, 64, 16, lambda c: True) is None
    assert choose_span([_span(5, 70)], 80, 48, 16, lambda c: True) is not None
    assert choose_span([], 80, 0, 16, lambda c: True) is None


def test_slot_mapping_matches_the_obvious_loop():
    blocks, bs = [9, 3, 14, 0], 8
    expect = [blocks[t // bs] * bs + t % bs for t in range(5, 29)]
    assert slot_mapping(blocks, 5, 29, bs).tolist() == expect
    with pytest.raises(ValueError, match="blocks"):
        slot_mapping(blocks, 0, 33, bs)


# ---- ragkv's side on the tiny model ------------------------------------------------------------
def _side(adapter, texts: Sequence[str], *, ratio: float = 0.15, tenant: str = "t1") -> RagkvSide:
    cfg = RetrieverConfig()
    store = open_store(["memory://"])
    prefix_ids = adapter.encode(adapter.layout(None).prefix)
    computer = ChunkComputer(adapter, store, prefix_ids, cfg.stored_codecs, tenant=tenant)
    layout = adapter.layout(None)
    for text in texts:
        computer.ensure_stored(adapter.encode(layout.chunk_text(text)))
    return RagkvSide(adapter, computer, cfg.codec, FusionConfig(ratio=ratio), lambda: list(texts))


def _prompt(adapter, *middle: str) -> list[int]:
    layout = adapter.layout(None)
    return adapter.encode(layout.prefix + "".join(middle) + layout.suffix_text("Where do apples grow?"))


def _chunk(adapter, text: str) -> str:
    return adapter.layout(None).chunk_text(text)


def test_rag_prompt_is_planned_through_its_last_chunk(llama_adapter):
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B])
    ids = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A), GAP, _chunk(llama_adapter, CHUNK_B))
    plan = side.plan(ids, 0, 16)
    assert plan is not None and len(plan.spans) == 2
    assert plan.end == plan.context_end and plan.end > 0
    assert side.plan(llama_adapter.encode("Nothing ragkv indexed is in here, only a question?"), 0, 16) is None


def test_fused_kv_with_every_token_recomputed_equals_a_plain_prefill(llama_adapter):
    """The fast path (stored chunks, re-rotated, recomputed) against the obvious one (prefill the prompt)."""
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B], ratio=1.0)
    ids = _prompt(llama_adapter, "Context:\n", _chunk(llama_adapter, CHUNK_A), GAP, _chunk(llama_adapter, CHUNK_B))
    plan = side.plan(ids, 16, 16)
    assert plan is not None and plan.start == 16
    fused = side.fused_kv(ids, plan)
    full = llama_adapter.prefill_kv(ids[: plan.context_end])
    assert fused.keys.shape == (4, 2, plan.new_tokens, 16)
    torch.testing.assert_close(fused.keys, full.keys[:, :, plan.start : plan.end], atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(fused.values, full.values[:, :, plan.start : plan.end], atol=2e-4, rtol=1e-3)


def test_text_before_the_chunks_is_prefilled_once_and_only_reused_for_the_same_ids(llama_adapter, monkeypatch):
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B], ratio=1.0)
    prefills: list[int] = []
    real = llama_adapter.prefill_kv
    monkeypatch.setattr(llama_adapter, "prefill_kv", lambda ids, past=(): prefills.append(len(ids)) or real(ids, past))
    for head in ("Context:\n", "Context:\n", "Other context here:\n"):
        ids = _prompt(llama_adapter, head, _chunk(llama_adapter, CHUNK_A), _chunk(llama_adapter, CHUNK_B))
        plan = side.plan(ids, 0, 16)
        assert plan is not None
        fused = side.fused_kv(ids, plan)
        full = real(ids[: plan.context_end]).slice(plan.start, plan.end)
        torch.testing.assert_close(fused.keys, full.keys, atol=2e-4, rtol=1e-3)
    assert len(prefills) == 2  # the repeated head was reused, the new one prefilled
    assert {"plan", "prefix", "entries", "fusion", "extract"} <= set(side.phase_s)


def test_default_fusion_stays_close_to_a_plain_prefill(llama_adapter):
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B])
    ids = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A), _chunk(llama_adapter, CHUNK_B))
    plan = side.plan(ids, 0, 16)
    assert plan is not None
    fused = side.fused_kv(ids, plan)
    full = llama_adapter.prefill_kv(ids[: plan.context_end]).slice(plan.start, plan.end)
    # stored caches are quantized and most chunk tokens keep their context-free K/V: close, not equal
    assert (fused.keys - full.keys).norm() / full.keys.norm() < 0.2  # 0.07 measured
    assert (fused.values - full.values).norm() / full.values.norm() < 0.2


def _key(side: RagkvSide, text: str) -> str:
    stored = tuple(side.adapter.encode(side.adapter.layout(None).chunk_text(text)))
    return side.key(KnownChunk(stored, len(stored))).storage_key


def test_damaged_entry_is_a_miss_logged_once(llama_adapter, caplog):
    side = _side(llama_adapter, [CHUNK_A])
    key = _key(side, CHUNK_A)
    blob = side.store.get(key)
    assert blob is not None
    side.store.put(key, blob[:-7] + b"garbage", cost=1.0)
    ids = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A))
    with caplog.at_level(logging.WARNING):
        assert side.plan(ids, 0, 16) is None
        assert side.plan(ids, 0, 16) is None
    assert sum("unusable cache entry" in r.getMessage() for r in caplog.records) == 1


def test_entry_of_another_tenant_is_a_miss(llama_adapter):
    ours = _side(llama_adapter, [CHUNK_A])
    theirs = _side(llama_adapter, [CHUNK_A], tenant="t2")
    foreign = theirs.store.get(_key(theirs, CHUNK_A))
    assert foreign is not None
    ours.store.put(_key(ours, CHUNK_A), foreign, cost=1.0)  # their bytes under our key
    assert ours.plan(_prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A)), 0, 16) is None


def test_a_bad_second_chunk_cuts_the_span_after_the_first(llama_adapter):
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B])
    side.store.put(_key(side, CHUNK_B), b"not a cache entry", cost=1.0)
    ids = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A), _chunk(llama_adapter, CHUNK_B))
    plan = side.plan(ids, 0, 16)
    assert plan is not None and len(plan.spans) == 1 and plan.context_end == plan.spans[0].end


def test_entry_vanished_after_scheduling_is_computed_in_place(llama_adapter, caplog):
    side = _side(llama_adapter, [CHUNK_A, CHUNK_B], ratio=1.0)
    ids = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A), _chunk(llama_adapter, CHUNK_B))
    plan = side.plan(ids, 0, 16)
    assert plan is not None
    side.store.invalidate(_key(side, CHUNK_A))
    side._decoded.clear()
    with caplog.at_level(logging.WARNING):
        fused = side.fused_kv(ids, plan)
    assert any("vanished" in r.getMessage() for r in caplog.records)
    full = llama_adapter.prefill_kv(ids[: plan.context_end]).slice(plan.start, plan.end)
    torch.testing.assert_close(fused.keys, full.keys, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(side.exact_kv(ids, plan).values, full.values, atol=2e-4, rtol=1e-3)


def test_store_down_is_a_miss(llama_adapter, monkeypatch, caplog):
    side = _side(llama_adapter, [CHUNK_A])

    def down(key: str) -> bytes | None:
        raise ConnectionError("connection refused")

    monkeypatch.setattr(side.store, "get", down)
    with caplog.at_level(logging.WARNING):
        assert side.plan(_prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A)), 0, 16) is None
    assert any("store unreadable" in r.getMessage() for r in caplog.records)


def test_catalog_down_is_a_miss(llama_adapter):
    side = _side(llama_adapter, [CHUNK_A])

    def broken() -> list[str]:
        raise OSError("catalog unreachable")

    side._texts, side._refresh_s = broken, 0.0
    assert side.plan(_prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A)), 0, 16) is None


# ---- save-back: a chunk vLLM computed, stored for ragkv -----------------------------------------
def _engine_side(engine) -> RagkvSide:
    """The connector's side over an engine's own model, store, keys and catalog."""
    from ragkv.retriever.precompute import record_stored

    r = engine.retriever
    texts = [c.text for c in engine.catalog.chunks_by_rows(engine.catalog.all_chunk_rows(r.tenant), r.tenant)]
    return RagkvSide(
        engine.adapter,
        r.computer,
        r.config.codec,
        FusionConfig(),
        lambda: texts,
        system=r.config.system,
        record=lambda entry: record_stored(engine.catalog, entry, tenant=r.tenant),
    )


def test_chunk_saved_back_from_vllms_kv_loads_in_ragkv_and_fuses_the_same(tmp_path, llama_adapter):
    """The fast path (a chunk stored from the prompt's K/V, as vLLM computed them) against the obvious
    one (the chunk precomputed by ragkv's indexing): a hit for ragkv, the same K/V, the same answer."""
    from tests.integrations.conftest import DOCS, GEN, make_engine

    engine = make_engine(tmp_path, llama_adapter)
    engine.index(DOCS, progress=False)
    r, question = engine.retriever, "How do boats move?"
    chunks = engine.retrieve(question)
    ids = llama_adapter.encode(
        r.layout.prefix + "".join(r.layout.chunk_text(c.text) for c in chunks) + r.layout.suffix_text(question)
    )
    first = r.chunk_token_ids(chunks[0].text)
    keys = [r.computer.chunk_key(first, spec).storage_key for spec in r.config.stored_codecs]
    indexed = {k: engine.store.get(k) for k in keys}
    reference = engine.answer(question, chunks=chunks, generation=GEN)
    before = r.loader.load(first).kv
    for k in keys:  # evicted: the catalog still knows the chunk, the store lost its cache
        engine.store.invalidate(k)

    side = _engine_side(engine)
    assert side.plan(ids, 0, 16) is None  # the first chunk cannot be served: vLLM computes the prompt
    span = side.saveable(ids)
    assert span is not None and span.start == len(r.computer.prefix_ids) and span.chunk.stored_ids == first
    computed = llama_adapter.prefill_kv(ids[: span.end]).slice(span.start, span.end)  # what vLLM's cache holds
    entries = side.save_chunk(ids, span, computed.keys, computed.values)
    assert sorted(e.storage_key for e in entries) == sorted(keys)
    assert all(engine.catalog.has_entry(k) for k in keys) and all(e.num_tokens == len(first) for e in entries)
    assert side.saveable(ids) is None  # stored now: nothing left to save

    loaded = r.loader.load(first)
    assert loaded.hit  # ragkv loads the saved entry (key, model fingerprint, codec, MAC all check)
    torch.testing.assert_close(loaded.kv.positions, before.positions)
    torch.testing.assert_close(loaded.kv.keys, before.keys, atol=0.05, rtol=0.05)
    torch.testing.assert_close(loaded.kv.values, before.values, atol=0.05, rtol=0.05)
    again = engine.answer(question, chunks=chunks, generation=GEN)
    assert again.stats.cache_hits == reference.stats.cache_hits and again.text == reference.text
    assert all(indexed[k] is not None for k in keys)
    engine.close()


def test_only_a_chunk_right_after_the_shared_prefix_is_saved(llama_adapter):
    side = _side(llama_adapter, [CHUNK_B])  # B stored, A known but never stored
    side._texts = lambda: [CHUNK_A, CHUNK_B]
    side.refresh(force=True)
    later = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_B), _chunk(llama_adapter, CHUNK_A))
    assert side.saveable(later) is None  # A follows B: its K/V attend to B, not ragkv's entry
    gap = _prompt(llama_adapter, GAP, _chunk(llama_adapter, CHUNK_A))
    assert side.saveable(gap) is None  # A is not where ragkv's indexing computes it
    first = _prompt(llama_adapter, _chunk(llama_adapter, CHUNK_A), _chunk(llama_adapter, CHUNK_B))
    span = side.saveable(first)
    assert span is not None and span.start == len(side.computer.prefix_ids)
    kv = llama_adapter.prefill_kv(first[: span.end]).slice(span.start, span.end)
    with pytest.raises(ValueError, match="not the prompt's tokens"):
        side.save_chunk(first, span, kv.keys[:, :, 1:], kv.values[:, :, 1:])
    moved = ChunkSpan(span.start + 2, span.end + 2, span.chunk)
    with pytest.raises(ValueError, match="right after"):
        side.save_chunk(first, moved, kv.keys, kv.values)


def test_a_chunk_found_by_its_core_is_saved_with_its_stored_tail(llama_adapter):
    """The prompt holds the chunk's text but not its closing blank line: ragkv computes those ids."""
    side = _side(llama_adapter, [CHUNK_B])
    side._texts = lambda: [CHUNK_A, CHUNK_B]
    side.refresh(force=True)
    ids = _prompt(llama_adapter, CHUNK_A + " " + GAP)
    span = side.saveable(ids)
    assert span is not None and span.end - span.start < len(span.chunk.stored_ids)
    kv = llama_adapter.prefill_kv(ids[: span.end]).slice(span.start, span.end)
    (entry, *_) = side.save_chunk(ids, span, kv.keys, kv.values)
    assert entry.num_tokens == len(span.chunk.stored_ids)
    saved = side.load(span.chunk)
    indexed = _side(llama_adapter, [CHUNK_A]).load(span.chunk)  # the same chunk precomputed by ragkv
    assert saved is not None and indexed is not None
    torch.testing.assert_close(saved.positions, indexed.positions)
    torch.testing.assert_close(saved.keys, indexed.keys, atol=0.05, rtol=0.05)
    torch.testing.assert_close(saved.values, indexed.values, atol=0.05, rtol=0.05)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.slow
def test_real_tokenizer_chunk_one_position_later_is_rotated_back(real_adapter):
    """SmolLM2 writes the prefix's closing blank line as two tokens before a chunk: the chunk sits one
    position later in the prompt than in ragkv's entry, after other separator ids. Saved from the
    prompt's K/V and rotated back, it fuses as well as the entry ragkv's indexing computes."""
    a = real_adapter
    side = _side(a, [CHUNK_B])
    side._texts = lambda: [CHUNK_A, CHUNK_B]
    side.refresh(force=True)
    ids = _prompt(a, _chunk(a, CHUNK_A), _chunk(a, CHUNK_B))
    span = side.saveable(ids)
    assert span is not None and span.start == len(side.computer.prefix_ids) + 1
    kv = a.prefill_kv(ids[: span.end]).slice(span.start, span.end)
    side.save_chunk(ids, span, kv.keys, kv.values)
    indexed = _side(a, [CHUNK_A, CHUNK_B])
    saved_kv, indexed_kv = side.load(span.chunk), indexed.load(span.chunk)
    assert saved_kv is not None and indexed_kv is not None
    torch.testing.assert_close(saved_kv.positions, indexed_kv.positions)
    # the separator's ids change every layer past the first a little (V 0.07 measured, the codec's own
    # error 0.08): 0.04 (K) and 0.12 (V) measured between the two stored entries
    assert _rel(saved_kv.keys, indexed_kv.keys) < 0.08 and _rel(saved_kv.values, indexed_kv.values) < 0.2
    assert _rel(kv.keys, indexed_kv.keys[:, :, : kv.num_tokens]) > 0.1  # unrotated: 0.16 measured
    # what counts: fused in another prompt, each is as close to that prompt's full prefill
    other = _prompt(a, _chunk(a, CHUNK_B), _chunk(a, CHUNK_A))
    errors = []
    for s in (side, indexed):
        plan = s.plan(other, 0, 16)
        assert plan is not None and len(plan.spans) == 2
        fused = s.fused_kv(other, plan)
        full = a.prefill_kv(other[: plan.context_end]).slice(plan.start, plan.end)
        errors.append((_rel(fused.keys, full.keys), _rel(fused.values, full.values)))
    (saved_k, saved_v), (indexed_k, indexed_v) = errors  # 0.074 / 0.155 and 0.074 / 0.158 measured
    assert saved_k < indexed_k * 1.1 + 0.005 and saved_v < indexed_v * 1.1 + 0.005, errors


# ---- inside vLLM (its own venv: bash tools/vllm_env.sh) -----------------------------------------
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# tools/vllm_env.sh (`make test-vllm`, CI) sets it: there a missing vLLM fails these tests, never skips them
REQUIRE_VLLM = os.environ.get("RAGKV_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM and not REQUIRE_VLLM,
    reason="vLLM is not installed here; it lives in its own venv: make test-vllm (builds it, runs these tests)",
)


def test_vllm_is_importable_where_it_is_required():
    if REQUIRE_VLLM and not HAS_VLLM:
        pytest.fail("RAGKV_REQUIRE_VLLM=1 but vLLM is not importable: run these tests with make test-vllm")


LEVEL1 = CodecSpec("cachegen", 1)
QA = os.path.join(os.path.dirname(__file__), "..", "..", "ragkv", "bench", "data", "qa_invented.json")


@pytest.fixture(scope="module")
def vllm_rig(tmp_path_factory):
    """An index of three documents made by ragkv, and one vLLM engine with the connector over its store."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the hook counts are readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from ragkv.engine import EngineConfig, RagKV
    from ragkv.model.loading import converted_folder
    from ragkv.model.placement import dtype_name
    from ragkv.retriever.documents import Document

    # the default model converted into this session's model cache, in the dtype ragkv picks here
    folder = str(converted_folder("smollm2-135m", "auto"))
    data_dir = tmp_path_factory.mktemp("vllm-data")
    with open(QA) as f:
        qa = json.load(f)
    engine = RagKV(EngineConfig(data_dir=data_dir, model=folder, device="cpu"))
    documents = [Document(f"qa:{d['id']}", d["text"], d["title"]) for d in qa["documents"][:3]]
    engine.index(documents, progress=False)
    question = qa["questions"][0]["question"]
    layout = engine.retriever.layout
    chunks = engine.retrieve(question)
    prompt = layout.prefix + "".join(layout.chunk_text(c.text) for c in chunks) + layout.suffix_text(question)
    ids = engine.adapter.encode(prompt)
    first_chunk = engine.retriever.chunk_token_ids(chunks[0].text)
    first_key = engine.retriever.computer.chunk_key(first_chunk, engine.config.retriever.codec).storage_key
    transfer = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"data_dir": str(data_dir)},
    )
    llm = LLM(
        model=folder,
        dtype=dtype_name(engine.adapter.dtype),  # both sides compute alike (vLLM's bf16 is emulated without it)
        max_model_len=4096,
        enable_prefix_caching=False,
        enforce_eager=True,
        kv_transfer_config=transfer,
        # prompts prefill over several steps: a chunk is saved back from the step that computes its end
        max_num_batched_tokens=256,
    )
    yield {
        "llm": llm,
        "ids": ids,
        "first_key": first_key,
        "engine": engine,
        "question": question,
        "documents": documents,
    }
    engine.close()


def _generate(llm, ids: list[int], *, ragkv: bool = True, max_tokens: int = 32):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if ragkv else {"kv_transfer_params": {"ragkv": False}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


@needs_vllm
@pytest.mark.slow
def test_connector_serves_a_rag_prompt_and_vllm_skips_those_tokens(vllm_rig):
    from ragkv.integrations.vllm import COUNTS

    llm, ids = vllm_rig["llm"], vllm_rig["ids"]
    base, base_cached = _generate(llm, ids, ragkv=False)
    served_before = COUNTS.served_tokens
    got, cached = _generate(llm, ids)
    for hook in (
        "register_kv_caches",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        "request_finished",
    ):
        assert COUNTS.hooks.get(hook, 0) > 0, hook
    assert base_cached == 0
    assert cached > 0 and cached == COUNTS.served_tokens - served_before  # through the last chunk, not whole blocks
    assert cached >= len(ids) // 2  # most of the prompt came from ragkv
    # token agreement, not golden text: KV from two kernels (and fusion) differs slightly
    agree = next((i for i, (a, b) in enumerate(zip(base, got, strict=False)) if a != b), min(len(base), len(got)))
    assert agree >= min(len(base), 16), (base, got)


@needs_vllm
@pytest.mark.slow
def test_a_load_while_vllm_steps_other_requests_answers_as_a_load_within_the_step(vllm_rig):
    from ragkv.integrations.vllm import COUNTS

    llm, ids = vllm_rig["llm"], vllm_rig["ids"]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector  # load_async is the scheduler's call
    within, cached = _generate(llm, ids, max_tokens=8)
    background = COUNTS.background_loads
    scheduler._async = True
    try:
        got, got_cached = _generate(llm, ids, max_tokens=8)
    finally:
        scheduler._async = False
    assert COUNTS.background_loads == background + 1  # it did load in the background
    assert got == within and got_cached == cached > 0


def _hold_fusion(vllm_rig, monkeypatch) -> tuple[threading.Event, Any]:
    """Make the connector's fusion wait for the returned event (a store that hangs); also returns
    the worker's connector. Undone by ``monkeypatch``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from ragkv.integrations import vllm as connector

    _generate(vllm_rig["llm"], vllm_rig["ids"], max_tokens=1)  # the connector's side exists from here on
    (side,) = connector._SIDES.values()
    release, fused_kv = threading.Event(), side.fused_kv

    def held(prompt_ids, plan):
        release.wait(60)
        return fused_kv(prompt_ids, plan)

    monkeypatch.setattr(side, "fused_kv", held)
    return release, get_kv_transfer_group()


@needs_vllm
@pytest.mark.slow
def test_a_load_past_its_timeout_is_computed_by_vllm_and_its_fusion_never_writes(vllm_rig, monkeypatch):
    from ragkv.integrations.vllm import COUNTS

    llm, ids = vllm_rig["llm"], vllm_rig["ids"]
    served, _ = _generate(llm, ids)
    base, _ = _generate(llm, ids, ragkv=False)
    release, worker = _hold_fusion(vllm_rig, monkeypatch)
    monkeypatch.setattr(worker, "_load_timeout", 0.5)
    timed_out, written = COUNTS.timed_out_loads, COUNTS.written_tokens
    try:
        got, _ = _generate(llm, ids)
    finally:
        release.set()
    worker._loader_pool().submit(lambda: None).result(timeout=120)  # the given-up fusion has ended
    assert COUNTS.timed_out_loads == timed_out + 1 and COUNTS.written_tokens == written  # never written
    assert got == base  # vLLM computed the blocks itself
    monkeypatch.undo()
    again, cached = _generate(llm, ids)
    assert cached > 0 and again == served  # the connector serves as before


@needs_vllm
@pytest.mark.slow
def test_a_request_aborted_while_its_background_load_runs_keeps_its_blocks_until_the_load_ends(vllm_rig, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ragkv.integrations.vllm import COUNTS

    llm, ids = vllm_rig["llm"], vllm_rig["ids"]
    served, _ = _generate(llm, ids, max_tokens=8)
    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    release, worker = _hold_fusion(vllm_rig, monkeypatch)
    monkeypatch.setattr(core.scheduler.connector, "_async", True)
    written = COUNTS.written_tokens
    try:
        llm.llm_engine.add_request("aborted", TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=4))
        llm.llm_engine.step()  # allocated; its load runs in the loader thread
        assert pool.get_num_free_blocks() < free
        llm.llm_engine.abort_request(["aborted"])
        for _ in range(3):
            llm.llm_engine.step()
        assert pool.get_num_free_blocks() < free  # the load may still write into them: not freed
    finally:
        release.set()
    deadline = time.monotonic() + 120
    while pool.get_num_free_blocks() < free and time.monotonic() < deadline:
        llm.llm_engine.step()
    assert pool.get_num_free_blocks() == free and COUNTS.written_tokens > written  # written, then freed
    assert not llm.llm_engine.has_unfinished_requests()
    monkeypatch.undo()
    assert _generate(llm, ids, max_tokens=8)[0] == served


@needs_vllm
@pytest.mark.slow
def test_unrecognized_request_runs_exactly_as_without_the_connector(vllm_rig):
    llm, engine = vllm_rig["llm"], vllm_rig["engine"]
    ids = engine.adapter.encode(
        "<|im_start|>user\nWrite two sentences about the sea.<|im_end|>\n<|im_start|>assistant\n"
    )
    base, _ = _generate(llm, ids, ragkv=False)
    got, cached = _generate(llm, ids)
    assert cached == 0 and got == base


@needs_vllm
@pytest.mark.slow
def test_damaged_entry_is_computed_by_vllm(vllm_rig):
    from ragkv.integrations import vllm as connector
    from ragkv.integrations.vllm import COUNTS

    llm, ids, key = vllm_rig["llm"], vllm_rig["ids"], vllm_rig["first_key"]
    _generate(llm, ids, max_tokens=1)  # the connector's side (its own store handle) exists from here on
    (side,) = connector._SIDES.values()
    blob = side.store.get(key)
    assert blob is not None
    try:
        side.store.invalidate(key)
        side.store.put(key, blob[: len(blob) // 2], cost=1.0)
        side._decoded.clear()  # entries checked earlier are kept decoded: forget them
        base, _ = _generate(llm, ids, ragkv=False)
        failed = COUNTS.failed_loads
        got, cached = _generate(llm, ids)
        assert cached == 0 and got == base and COUNTS.failed_loads == failed
    finally:
        side.store.invalidate(key)
        side.store.put(key, blob, cost=1.0)


def _agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens two greedy answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@needs_vllm
@pytest.mark.slow
def test_transform_coded_chunks_are_served_and_a_damaged_transform_is_a_miss(vllm_rig, tmp_path, monkeypatch):
    """Chunks indexed at cachegen level 1, coded in the channel transform: a connector set up with the
    indexer's ``codec: cachegen:1`` keys and decodes them with the store's transform and vLLM skips
    them; once the transform entry it reads is damaged they are misses and vLLM computes the prompt."""
    from ragkv.codec.transform import transform_key
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.integrations import vllm as connector
    from ragkv.integrations._vllm_config import build_side, engine_config
    from ragkv.integrations.vllm import COUNTS
    from ragkv.retriever.embedder import HashingEmbedder

    llm, ids, engine = vllm_rig["llm"], vllm_rig["ids"], vllm_rig["engine"]
    # the rig's documents indexed again, at level 1 (the transform is on there by default), same model
    coded_cfg = EngineConfig(data_dir=tmp_path, model=engine.config.model, retriever=RetrieverConfig(codec=LEVEL1))
    with RagKV(coded_cfg, adapter=engine.adapter, embedder=HashingEmbedder(dim=64)) as coded_engine:
        coded_engine.index(vllm_rig["documents"], progress=False)
        held = coded_engine.retriever.computer.transforms.current()
        assert held is not None
        _generate(llm, ids, max_tokens=1)  # the connector's side exists from here on
        (side,) = connector._SIDES.values()
        cfg = engine_config(str(engine.config.model), {"data_dir": str(tmp_path), "codec": "cachegen:1"})
        coded = build_side(side.adapter, coded_engine.store, coded_engine.catalog, cfg)  # what that config builds
        for name in ("codec", "computer", "store"):
            monkeypatch.setattr(side, name, getattr(coded, name))
        side._decoded.clear()
        try:
            base, _ = _generate(llm, ids, ragkv=False)
            served = COUNTS.served_tokens
            got, cached = _generate(llm, ids)
            assert coded.computer.transforms.digest() == held.digest
            assert cached >= len(ids) // 2 and cached == COUNTS.served_tokens - served
            assert _agreement(base, got) >= min(len(base), 16), (base, got)  # 14 of 14 measured
            key = transform_key(coded_engine.retriever.tenant, engine.adapter.fingerprint)
            blob = bytearray(coded_engine.store.get(key) or b"")
            blob[len(blob) // 2] ^= 0x40
            coded_engine.store.invalidate(key)
            coded_engine.store.put(key, bytes(blob))
            assert coded.computer.transforms.reload() is None  # as its refresh does when chunks are indexed
            side._decoded.clear()
            got, cached = _generate(llm, ids)
            assert cached == 0 and got == base
        finally:
            side._decoded.clear()


@needs_vllm
def test_reading_vllms_paged_cache_returns_what_its_op_wrote():
    """read_paged (a gather through a probed map) against the values written with vLLM's own op."""
    from ragkv.integrations._vllm_paged import read_paged, write_paged

    for heads, head_dim in ((3, 64), (2, 32)):
        cache = torch.zeros(7, heads, 128, 2 * head_dim, dtype=torch.bfloat16)
        slots = torch.tensor([130, 131, 5, 890, 889, 6 * 128 + 127])
        k = torch.randn(len(slots), heads, head_dim).bfloat16()
        v = torch.randn(len(slots), heads, head_dim).bfloat16()
        write_paged(k, v, cache, slots, None, "auto")
        got_k, got_v = read_paged(cache, slots, None, "auto")
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


@needs_vllm
@pytest.mark.slow
def test_chunk_vllm_computes_is_saved_back_and_then_served(vllm_rig):
    """An evicted chunk: vLLM computes it, the connector stores it from vLLM's blocks, ragkv loads it
    as a hit whose K/V match its own indexing's, its answer is unchanged, and vLLM is served it next."""
    from ragkv.generation import GenerationConfig
    from ragkv.integrations import vllm as connector
    from ragkv.integrations.vllm import COUNTS

    llm, ids, engine = vllm_rig["llm"], vllm_rig["ids"], vllm_rig["engine"]
    r = engine.retriever
    question = vllm_rig["question"]
    chunks = engine.retrieve(question)
    first = r.chunk_token_ids(chunks[0].text)
    keys = [r.computer.chunk_key(first, spec).storage_key for spec in r.config.stored_codecs]
    indexed = r.loader.load(first).kv
    gen = GenerationConfig(max_new_tokens=12)
    reference = engine.answer(question, chunks=chunks, generation=gen)
    _generate(llm, ids, max_tokens=1)  # the connector's side exists from here on
    (side,) = connector._SIDES.values()
    blobs = {k: side.store.get(k) for k in keys}
    try:
        for k in keys:
            side.store.invalidate(k)
            engine.store.invalidate(k)
        side._decoded.clear()
        saved_before = COUNTS.saved_chunks
        base, _ = _generate(llm, ids, ragkv=False)
        got, cached = _generate(llm, ids)
        assert cached == 0 and got == base  # a miss: vLLM computed the prompt itself (256 tokens a step) ...
        assert len(ids) > 2 * 256
        assert COUNTS.saved_chunks == saved_before + 1 and COUNTS.failed_saves == 0  # ... and it was stored
        loaded = r.loader.load(first)
        assert loaded.hit
        # vLLM's kernels and the prefix's blank line as two ids (see the rotation test above): close, not equal
        k_err, v_err = (
            _rel(loaded.kv.keys.float(), indexed.keys.float()),
            _rel(loaded.kv.values.float(), indexed.values.float()),
        )
        assert k_err < 0.1 and v_err < 0.2, (k_err, v_err)
        again = engine.answer(question, chunks=chunks, generation=gen)
        assert again.stats.cache_hits == reference.stats.cache_hits and again.text == reference.text
        _, cached = _generate(llm, ids, max_tokens=1)
        assert cached > 0  # the saved chunk is served to vLLM again
    finally:
        for k, blob in blobs.items():
            if blob is not None:
                side.store.invalidate(k)
                side.store.put(k, blob, cost=1.0)
        side._decoded.clear()


@needs_vllm
def test_a_failing_save_is_logged_once_per_reason(caplog):
    """A store that is down fails every save the same way: one warning, the rest at debug; counted."""
    from ragkv.integrations import vllm as connector
    from ragkv.integrations.vllm import COUNTS, RagkvConnector, RagkvConnectorMetadata, _Save

    worker = RagkvConnector.__new__(RagkvConnector)  # only the save path's state: a fault injected below
    worker._save_failures = set()
    meta = RagkvConnectorMetadata(saves=[_Save(f"r{i}", [], None, []) for i in range(3)])
    worker.has_connector_metadata = lambda: True
    worker._get_connector_metadata = lambda: meta

    def down(save):
        raise ConnectionError("redis://127.0.0.1:1 refused")

    worker._save = down
    failed = COUNTS.failed_saves
    with caplog.at_level("DEBUG", logger=connector.__name__):
        worker.wait_for_save()
        worker.wait_for_save()
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "saving a chunk" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0].getMessage()
    assert COUNTS.failed_saves == failed + 6


# ---- background loads (load_async): the bookkeeping vLLM relies on ------------------------------
def _worker_for_background_loads():
    from ragkv.integrations.vllm import RagkvConnector

    worker = RagkvConnector.__new__(RagkvConnector)  # only the worker's load state
    worker._in_flight, worker._ended, worker._idle_step = {}, set(), False
    worker._failed_blocks, worker._failed_lock = set(), threading.Lock()
    worker._loader, worker._fusion_threads, worker._block_size = None, None, 4
    worker._watch, worker._load_timeout = {}, 0.0
    worker._side_obj = SimpleNamespace(say_once=lambda why: None)
    return worker


@needs_vllm
def test_a_background_load_is_reported_loaded_once_and_an_aborted_ones_blocks_wait_for_its_end():
    from concurrent.futures import Future

    worker = _worker_for_background_loads()
    a, b = Future(), Future()
    worker._in_flight = {"a": a, "b": b}
    assert worker.get_finished(set()) == (None, None)
    a.set_result(None)
    assert worker.get_finished(set()) == (None, {"a"})
    # b ends (aborted) while it still loads: vLLM frees its blocks only once the load is over
    assert worker.get_finished({"b"}) == (None, None)
    worker._idle_step = True  # nothing else to run: waits a little for the load, then says so
    assert worker.get_finished(set()) == (None, None)
    b.set_result(None)
    assert worker.get_finished(set()) == ({"b"}, None)
    assert worker.get_finished(set()) == (None, None) and not worker._in_flight and not worker._ended


@needs_vllm
def test_a_failed_background_load_reports_its_blocks_no_later_than_its_end():
    from ragkv.integrations.vllm import COUNTS, _Gate, _Load

    worker = _worker_for_background_loads()

    def broken(load, gate):
        raise RuntimeError("injected")

    worker._load = broken
    plan = ServePlan((_span(4, 12),), 12, 4, 12)
    load = _Load("r", list(range(20)), plan, [10, 11, 12, 13, 14], background=True)
    failed = COUNTS.failed_loads
    worker._in_flight["r"] = worker._loader_pool().submit(worker._load_or_fail, load, _Gate())
    worker._in_flight["r"].result(timeout=30)
    _, loaded = worker.get_finished(set())
    assert loaded == {"r"} and worker.get_block_ids_with_load_errors() == {11, 12}
    assert COUNTS.failed_loads == failed + 1
    worker.shutdown()


def _slow_side(release: threading.Event, num_layers: int = 2):
    """A ragkv side whose fusion waits for ``release`` (a store that hangs), then returns real-shaped K/V."""
    from ragkv.types import ChunkKV

    def fused_kv(ids, plan):
        release.wait(30)
        shape = (num_layers, 1, plan.end - plan.start, 4)
        return ChunkKV(torch.ones(shape), torch.ones(shape), torch.arange(plan.start, plan.end), "test")

    return SimpleNamespace(fused_kv=fused_kv, say_once=lambda why: None, add_time=lambda step, since: None)


def _timed_worker(monkeypatch, release: threading.Event, timeout_s: float) -> tuple[Any, list[Any]]:
    """A worker over two 4-slot cache layers whose fusion waits for ``release``, and the writes it makes."""
    from ragkv.integrations import vllm as connector

    worker = _worker_for_background_loads()
    worker._side_obj = _slow_side(release)
    worker._kv_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 4, 4) for i in range(2)}
    worker._isa, worker._kv_cache_dtype, worker._load_timeout = {}, "auto", timeout_s
    writes: list[Any] = []
    monkeypatch.setattr(connector, "write_paged", lambda *a: writes.append(a))
    return worker, writes


@needs_vllm
@pytest.mark.parametrize("background", [False, True])
def test_a_load_past_its_timeout_is_given_up_and_never_writes(monkeypatch, background):
    """A fusion that hangs past load_timeout_s: its blocks are reported failed and the step goes on;
    when the fusion ends later, nothing is written into blocks vLLM has recomputed (or reused)."""
    from ragkv.integrations.vllm import COUNTS, _Gate, _Load

    release = threading.Event()
    worker, writes = _timed_worker(monkeypatch, release, 0.05)
    plan = ServePlan((_span(4, 12),), 12, 4, 12)
    load = _Load("r", list(range(20)), plan, [10, 11, 12, 13, 14], background=background)
    given_up, failed = COUNTS.timed_out_loads, COUNTS.failed_loads
    gate = _Gate()
    job = worker._loader_pool().submit(worker._load_or_fail, load, gate)
    if background:
        worker._in_flight["r"] = job
        worker._watch["r"] = (time.monotonic() + 0.05, gate, load)
        assert worker.get_finished(set()) == (None, None)  # not overdue yet
        time.sleep(0.1)
        assert worker.get_finished(set()) == (None, {"r"})  # given up: reported ended, not left hanging
        assert not worker._in_flight and not worker._watch
    else:
        worker._wait(job, gate, load)  # returns at the timeout, the fusion still running
        assert not job.done()
    assert worker.get_block_ids_with_load_errors() == {11, 12}
    assert (COUNTS.timed_out_loads, COUNTS.failed_loads) == (given_up + 1, failed + 1)
    release.set()
    job.result(timeout=30)
    assert writes == []  # its result came too late: never written
    assert worker.get_block_ids_with_load_errors() == set()  # and its blocks not reported twice
    worker.shutdown()


@needs_vllm
def test_a_load_within_its_timeout_writes_every_layer(monkeypatch):
    from ragkv.integrations.vllm import COUNTS, _Gate, _Load

    release = threading.Event()
    release.set()
    worker, writes = _timed_worker(monkeypatch, release, 30.0)
    plan = ServePlan((_span(4, 12),), 12, 4, 12)
    load = _Load("r", list(range(20)), plan, [10, 11, 12, 13, 14])
    given_up = COUNTS.timed_out_loads
    gate = _Gate()
    worker._wait(worker._loader_pool().submit(worker._load_or_fail, load, gate), gate, load)
    assert len(writes) == 2 and worker.get_block_ids_with_load_errors() == set()
    assert COUNTS.timed_out_loads == given_up and not gate.give_up()  # written: too late to give up
    worker.shutdown()


@needs_vllm
def test_a_gate_lets_exactly_one_of_write_and_give_up_win():
    from ragkv.integrations.vllm import _Gate

    first = _Gate()
    assert first.give_up() and not first.begin_write() and not first.fail()  # given up: never writes
    second = _Gate()
    assert second.begin_write() and not second.give_up()  # writing: the step waits for it
    assert second.fail()  # a write that fails is reported (its blocks may be half written)
    third = _Gate()
    assert third.fail() and not third.give_up()  # failed and reported once


@needs_vllm
def test_the_scheduler_keeps_an_aborted_requests_blocks_while_its_load_runs():
    from ragkv.integrations.vllm import RagkvConnector, RagkvConnectorMetadata, _Load

    sched = RagkvConnector.__new__(RagkvConnector)  # only the scheduler's state
    sched._plans, sched._pending, sched._save_wanted, sched._saving = {}, {}, {}, {}
    sched._to_load, sched._loading = {}, set()
    plan = ServePlan((_span(4, 12),), 12, 4, 12)
    sched._to_load["r"] = _Load("r", list(range(20)), plan, [10, 11, 12], background=True)
    sched._to_load["s"] = _Load("s", list(range(20)), plan, [20, 21, 22], background=True)
    sched._to_load["q"] = _Load("q", list(range(20)), plan, [30, 31, 32], background=True)
    # aborted before its load reached the worker: still handed over, its blocks kept until it ends
    assert sched.request_finished(SimpleNamespace(request_id="q"), [30, 31, 32]) == (True, None)
    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
    meta = sched.build_connector_meta(out)
    assert isinstance(meta, RagkvConnectorMetadata) and [x.req_id for x in meta.loads] == ["r", "s", "q"]
    sched.update_connector_output(SimpleNamespace(finished_recving=None, finished_sending={"q"}))
    assert sched.request_finished(SimpleNamespace(request_id="r"), [10, 11, 12]) == (True, None)
    sched.update_connector_output(SimpleNamespace(finished_recving={"s"}, finished_sending={"r"}))
    assert sched.request_finished(SimpleNamespace(request_id="s"), [20, 21, 22]) == (False, None)
    assert not sched._loading
