"""Planned loads through the engine on a tiny model: text fallback, a tier failing mid-load, stats."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.errors import StoreUnavailableError
from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.planner.config import LoadConfig
from ragkv.planner.plan import LOCAL, TEXT, ChunkOptions, Rates, plan_seconds
from ragkv.planner.session import LoadPlanning
from ragkv.planner.throughput import RateEstimate
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import Chunk, CodecSpec

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 12 + "\n\nThey are red or green. " * 8, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 10 + "\n\nSails catch the wind. " * 9, "boats"),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 11, "clocks"),
]
GEN = GenerationConfig(max_new_tokens=8)
LEVELS = (CodecSpec("cachegen", 0), CodecSpec("cachegen", 3))


def _engine(tmp_path: Path, adapter, **kw) -> RagKV:
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=RetrieverConfig(
            top_k=3, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=LEVELS[0], index_codecs=LEVELS[1:]
        ),
        store=("memory://",),
        fusion=FusionConfig(method="naive", ratio=0.0),
        **kw,
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _three_chunks(rag: RagKV) -> list[Chunk]:
    rag.index(DOCS, progress=False)
    unique = {c.text: c for c in rag.retrieve("apples boats clocks", k=8)}
    assert len(unique) >= 3
    return list(unique.values())[:3]


def test_no_deadline_on_a_fast_tier_loads_the_best_level(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        chunks = _three_chunks(rag)
        s = rag.answer("Where do apples grow?", chunks=chunks, generation=GEN).stats
        load = s.extra["load"]
        assert load["choices"] == ["cachegen:0"] * 3 and s.cache_hits == 3
        assert sum(load["bytes_by_tier"].values()) == s.bytes_loaded > 0
        assert load["bandwidth_mbit"] > 0 and load["deadline_ms"] is None and "deadline_met" not in load


def test_chunks_planned_as_text_equal_full_prefill(tmp_path, llama_adapter):
    """Recompute made cheap (a huge prefill speed estimate): every chunk is text, fusion computes it in
    place, and the answer is full prefill's, with no bytes read."""
    with _engine(tmp_path, llama_adapter, load=LoadConfig(slo_ms=60_000)) as rag:
        chunks = _three_chunks(rag)
        rag.load_estimates.recompute = RateEstimate(1e15)
        reuse = rag.answer("What do sails do?", chunks=chunks, generation=GEN)
        full = rag.answer("What do sails do?", chunks=chunks, mode="full", generation=GEN)
        load = reuse.stats.extra["load"]
        assert load["choices"] == ["text"] * 3 and reuse.stats.bytes_loaded == 0 and load["deadline_met"] is True
        assert reuse.stats.prefilled_chunk_tokens == sum(len(c.token_ids) for c in chunks)
        assert reuse.text == full.text and reuse.stats.generated_tokens == full.stats.generated_tokens


def test_a_tier_failing_mid_load_moves_the_rest_to_text(tmp_path, llama_adapter, monkeypatch):
    with _engine(tmp_path, llama_adapter) as rag:
        chunks = _three_chunks(rag)
        tier = rag.store.tiers[0]
        get = tier._get
        calls: list[str] = []

        def fails_after_one(key: str) -> bytes | None:  # a fault injected at the tier boundary
            calls.append(key)
            if len(calls) > 1:
                raise StoreUnavailableError("connection reset")
            return get(key)

        monkeypatch.setattr(tier, "_get", fails_after_one)
        res = rag.answer("How do clocks work?", chunks=chunks, generation=GEN)
        load = res.stats.extra["load"]
        assert load["choices"] == ["cachegen:0", "text", "text"] and load["tier_failed"] is True
        assert len(calls) == 2  # after the failure nothing waits on the tier again
        assert res.stats.generated_tokens > 0 and res.stats.cache_hits == 1


def test_a_fixed_level_loads_that_level_without_planning(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, load=LoadConfig(fixed=LEVELS[1])) as rag:
        chunks = _three_chunks(rag)
        s = rag.answer("Where do apples grow?", chunks=chunks, generation=GEN).stats
        assert s.cache_hits == 3 and s.extra["load"]["choices"] == ["cachegen:3"] * 3


@pytest.mark.parametrize(
    ("kw", "err"),
    [({"slo_ms": 0}, ValueError), ({"slo_ms": True}, ValueError), ({"fixed": "cachegen:0"}, TypeError)],
)
def test_bad_load_settings_are_refused(kw, err):
    with pytest.raises(err):
        LoadConfig(**kw)


def test_the_next_engine_on_a_data_dir_starts_from_the_measured_speeds(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        chunks = _three_chunks(rag)
        rag.answer("Where do apples grow?", chunks=chunks, generation=GEN)
        rag.answer("Where do apples grow?", chunks=chunks, mode="full", generation=GEN)  # measures prefill
        measured = rag.load_estimates.recompute.rate
        decode = rag.load_estimates.decode_rates()
    assert (tmp_path / "load_rates.json").exists() and "cachegen:0" in decode
    with _engine(tmp_path, llama_adapter) as again:
        assert again.load_estimates.recompute.samples == 1 and again.load_estimates.recompute.rate == measured
        assert again.load_estimates.decode("cachegen:0").rate == decode["cachegen:0"]
    with _engine(tmp_path / "off", llama_adapter, load=LoadConfig(persist=False)) as rag:
        rag.answer("Where do apples grow?", chunks=_three_chunks(rag), generation=GEN)
    assert not (tmp_path / "off" / "load_rates.json").exists()


def test_a_chunk_planned_local_is_prefilled_here_while_the_next_one_is_read(tmp_path, llama_adapter, monkeypatch):
    """Under a deadline only the overlapped plan meets, the first chunk is prefilled on the caller's
    thread while the fetch thread already reads the second (no sleep decides it: the prefill waits for
    that read to start, so a loader that read only after prefilling would time out), and its cache is
    the one a fresh prefill after the shared prefix gives."""
    with _engine(tmp_path, llama_adapter) as rag:
        retriever = rag.retriever
        segments = [c.token_ids for c in _three_chunks(rag)]
        keys = [retriever.computer.chunk_key(s, LEVELS[1]).storage_key for s in segments]
        found = retriever.catalog.entry_sizes(keys)
        chunks = [ChunkOptions(len(s), {LEVELS[1]: found[k]}) for s, k in zip(segments, keys, strict=True)]
        # estimates only: prefill 1 token/s, and a link on which each level-3 read takes at most 0.9 of
        # its chunk's prefill: all level 3 beats all text, prefilling the first chunk while the other two
        # are read beats both, and the deadline lies between the two
        estimates = rag.load_estimates
        estimates.recompute = RateEstimate(1.0)
        rate = max(c.sizes[LEVELS[1]] / (0.9 * c.tokens) for c in chunks)
        for link in rag.store.read_estimates().values():
            link.seed(rate, 0.0)
        rates = Rates(rate, 1.0, {str(LEVELS[1]): estimates.decode(str(LEVELS[1])).rate})
        overlap_s = plan_seconds(chunks, [LOCAL, LEVELS[1], LEVELS[1]], rates)
        level3_s = plan_seconds(chunks, [LEVELS[1]] * 3, rates)
        assert overlap_s < level3_s < plan_seconds(chunks, [TEXT] * 3, rates)
        started, read_started = threading.Event(), threading.Event()
        overlapped: list[bool] = []
        tier = rag.store.tiers[0]
        get, prefill = tier._get, retriever.adapter.prefill_kv

        def reading(key: str) -> bytes | None:
            read_started.set()
            return get(key)

        def prefilling(*args, **kw):
            started.set()
            overlapped.append(read_started.wait(timeout=20))
            return prefill(*args, **kw)

        monkeypatch.setattr(tier, "_get", reading)
        monkeypatch.setattr(retriever.adapter, "prefill_kv", prefilling)
        plan = LoadPlanning(LoadConfig(slo_ms=1), estimates, time.perf_counter() + (overlap_s + level3_s) / 2)
        loaded, report = retriever.loader.load_planned(segments, plan)
        monkeypatch.undo()
        assert report is not None
        choices = report["choices"]
        assert choices[0] == "local" and choices[1].startswith("cachegen:")
        assert overlapped == [True] * choices.count("local")
        first = loaded[0]
        assert first.local and not first.hit and not first.recompute and first.nbytes == 0
        fresh = retriever.adapter.prefill_kv(segments[0], past=[retriever.computer.prefix_kv()])
        assert torch.equal(first.kv.keys, fresh.keys) and torch.equal(first.kv.values, fresh.values)
        assert torch.equal(first.kv.positions, fresh.positions)
        assert loaded[1].hit and not loaded[1].local


def test_decodes_on_several_threads_are_measured_for_the_next_plan(tmp_path, llama_adapter, monkeypatch):
    """A planned load on two decode threads records how its decodes overlapped (here the first two run
    together: a barrier only two decodes in flight at once can pass); one thread records nothing."""
    with _engine(tmp_path, llama_adapter) as rag:
        segments = [c.token_ids for c in _three_chunks(rag)]
        loader, estimates = rag.retriever.loader, rag.load_estimates
        overlap = estimates.decode_overlap
        loader.decode_workers = 1
        loader.load_planned(segments, LoadPlanning(LoadConfig(), estimates))
        assert overlap.samples == 0
        both_in = threading.Barrier(2, timeout=30)
        seen = [0]
        lock = threading.Lock()
        decode = loader._decode

        def together(*args):
            with lock:
                seen[0] += 1
                first_two = seen[0] <= 2
            if first_two:
                both_in.wait()
                time.sleep(0.05)  # both hold their decode for a while after meeting
            return decode(*args)

        monkeypatch.setattr(loader, "_decode", together)
        loader.decode_workers = 2
        loaded, report = loader.load_planned(segments, LoadPlanning(LoadConfig(), estimates))
        assert report is not None and all(x.hit for x in loaded) and seen[0] == 3
        assert overlap.samples == 1 and overlap.rate > 1.0
