"""The vLLM connector's settings and its side's keys (no vLLM needed): the indexer's codecs and channel
transform, read from the store; a missing, damaged or foreign transform entry is a miss (vLLM computes)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from ragkv.codec import read_header
from ragkv.codec.transform import transform_blob, transform_key
from ragkv.engine import EngineConfig, RagKV
from ragkv.integrations._vllm_config import (
    DEFAULT_LOAD_TIMEOUT_S,
    ConnectorOptions,
    build_side,
    connector_options,
    engine_config,
)
from ragkv.integrations._vllm_core import RagkvSide
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.retriever.transforms import UNCALIBRATED
from ragkv.types import CodecSpec
from tests.integrations.conftest import DOCS

LEVEL1 = CodecSpec("cachegen", 1)
QUESTION = "How do boats move?"


# ---- settings ---------------------------------------------------------------------------------
def test_settings_take_the_indexers_codecs_and_transform_levels():
    cfg = engine_config("m", {"codec": "cachegen:1", "index_codecs": ["cachegen:2", "int8:0"], "transform_levels": [1]})
    assert cfg.retriever.codec == LEVEL1 and cfg.model == "m" and cfg.device == "cpu"
    assert cfg.retriever.index_codecs == (CodecSpec("cachegen", 2), CodecSpec("int8", 0))
    assert cfg.retriever.transform.levels == (1,)
    as_text = engine_config("m", {"index_codecs": "cachegen:2", "transform_levels": "1,2"})
    assert as_text.retriever.index_codecs == (CodecSpec("cachegen", 2),)
    assert as_text.retriever.transform.levels == (1, 2)
    assert engine_config("m", {"transform_levels": []}).retriever.transform.levels == ()
    assert engine_config("m", {}).retriever == RetrieverConfig()  # not given: the indexer's defaults


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"codec": "cachegen"}, "name:level"),
        ({"codec": "cachegen:x"}, "name:level"),
        ({"index_codecs": ["cachegen:1", "int8"]}, "name:level"),
        ({"transform_levels": [-1]}, "transform_levels"),
        ({"transform_levels": 1}, "transform_levels"),
        ({"transforms": [1]}, "unknown ragkv settings.*transform_levels"),
    ],
)
def test_a_setting_written_wrong_says_how_to_write_it(extra, match):
    with pytest.raises(ValueError, match=match):
        engine_config("m", extra)


def test_connector_options_default_to_a_load_within_the_step_on_every_cpu():
    assert connector_options({}) == ConnectorOptions(False, None, DEFAULT_LOAD_TIMEOUT_S)
    assert connector_options({"load_async": False, "fusion_threads": 4}) == ConnectorOptions(False, 4)
    assert connector_options({"load_async": "off", "fusion_threads": "2", "load_timeout_s": "2.5"}) == (
        ConnectorOptions(False, 2, 2.5)
    )
    assert connector_options({"load_timeout_s": 0}).load_timeout_s == 0  # no limit
    # known settings, not part of the keys
    engine_config("m", {"load_async": True, "fusion_threads": 2, "load_timeout_s": 30})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"load_async": "sometimes"}, "load_async takes true or false"),
        ({"fusion_threads": 0}, "fusion_threads takes an integer >= 1"),
        ({"fusion_threads": "two"}, "fusion_threads takes an integer >= 1"),
        ({"fusion_threads": True}, "fusion_threads takes an integer >= 1"),
        ({"load_timeout_s": -1}, "load_timeout_s takes seconds >= 0"),
        ({"load_timeout_s": "soon"}, "load_timeout_s takes seconds >= 0"),
        ({"load_timeout_s": float("inf")}, "load_timeout_s takes seconds >= 0"),
        ({"load_timeout_s": True}, "load_timeout_s takes seconds >= 0"),
    ],
)
def test_a_connector_option_written_wrong_says_how_to_write_it(extra, match):
    with pytest.raises(ValueError, match=match):
        connector_options(extra)


# ---- keys in the channel transform ------------------------------------------------------------
def _engine(data_dir: Path, adapter) -> RagKV:
    """An engine storing chunks at cachegen level 1, coded in the channel transform (on by default there)."""
    cfg = EngineConfig(
        data_dir=data_dir,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=LEVEL1),
        store=("memory://", str(data_dir / "kv")),
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _side(engine: RagKV, **extra) -> RagkvSide:
    """The connector's side over the engine's model, store and catalog, set up as its extra config says."""
    cfg = engine_config("m", {"data_dir": str(engine.config.data_dir), "codec": "cachegen:1", **extra})
    return build_side(engine.adapter, engine.store, engine.catalog, cfg)


def _prompt(engine: RagKV) -> tuple[list[int], list[tuple[int, ...]]]:
    """A RAG prompt's ids over the question's chunks, and those chunks' stored ids."""
    r = engine.retriever
    chunks = engine.retrieve(QUESTION)
    text = r.layout.prefix + "".join(r.layout.chunk_text(c.text) for c in chunks) + r.layout.suffix_text(QUESTION)
    return engine.adapter.encode(text), [r.chunk_token_ids(c.text) for c in chunks]


@pytest.fixture
def indexed(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as engine:
        engine.index(DOCS, progress=False)
        yield engine


def test_connector_keys_digest_the_stored_transform_and_decode_as_ragkv_does(indexed):
    """The fast path (the connector's keys and decode) against the obvious one (ragkv's own loader)."""
    held = indexed.retriever.computer.transforms.current()
    assert held is not None
    side = _side(indexed)
    ids, stored = _prompt(indexed)
    plan = side.plan(ids, 0, 16)
    assert plan is not None and [s.chunk.stored_ids for s in plan.spans] == stored
    for span in plan.spans:
        key = side.key(span.chunk)
        assert key.transform_digest == held.digest
        assert key.storage_key == indexed.retriever.computer.chunk_key(span.chunk.stored_ids, LEVEL1).storage_key
        got, want = side.load(span.chunk), indexed.retriever.loader.load(span.chunk.stored_ids)
        assert got is not None and want.hit
        assert torch.equal(got.keys, want.kv.keys) and torch.equal(got.values, want.kv.values)
    # without the transform setting its keys are not the indexer's: every chunk a miss, vLLM computes
    assert _side(indexed, transform_levels=[]).plan(ids, 0, 16) is None


def test_fused_kv_over_transform_coded_chunks_with_every_token_recomputed_equals_a_plain_prefill(indexed):
    side = _side(indexed, fusion_ratio=1.0)
    ids, _ = _prompt(indexed)
    plan = side.plan(ids, 0, 16)
    assert plan is not None
    fused = side.fused_kv(ids, plan)
    full = indexed.adapter.prefill_kv(ids[: plan.context_end]).slice(plan.start, plan.end)
    torch.testing.assert_close(fused.keys, full.keys, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(fused.values, full.values, atol=2e-4, rtol=1e-3)


def _spoil_transform(engine: RagKV, case: str) -> None:
    key = transform_key(engine.retriever.tenant, engine.adapter.fingerprint)
    good, sound = engine.store.get(key), engine.retriever.computer.transforms.current()
    assert good is not None and sound is not None
    engine.store.invalidate(key)
    if case == "damaged":
        blob = bytearray(good)
        blob[len(blob) // 2] ^= 0x40
        engine.store.put(key, bytes(blob))
    elif case == "foreign":  # a sound transform of another model, under this model's key
        engine.store.put(key, transform_blob(dataclasses.replace(sound, model_fingerprint="another-model"), key=key))


def test_a_chunk_saved_back_is_coded_in_the_stored_transform_and_loads_in_ragkv(indexed):
    """Save-back at a level coded in the transform: the entry is coded in the one the indexer stored,
    under the indexer's key, and ragkv's loader decodes it as a hit."""
    held = indexed.retriever.computer.transforms.current()
    assert held is not None
    side = _side(indexed)
    ids, stored = _prompt(indexed)
    key = indexed.retriever.computer.chunk_key(stored[0], LEVEL1)
    indexed.store.invalidate(key.storage_key)  # evicted: vLLM computes the first chunk ...
    assert side.plan(ids, 0, 16) is None
    span = side.saveable(ids)  # ... and the connector stores it from vLLM's K/V
    assert span is not None and span.chunk.stored_ids == stored[0]
    kv = indexed.adapter.prefill_kv(ids[: span.end]).slice(span.start, span.end)  # what vLLM's cache holds
    (entry,) = side.save_chunk(ids, span, kv.keys, kv.values)
    assert entry.storage_key == key.storage_key
    assert read_header(indexed.store.get(key.storage_key)).params["transform"] == held.digest
    loaded = indexed.retriever.loader.load(stored[0])
    exact = indexed.adapter.prefill_kv(stored[0], past=[indexed.retriever.computer.prefix_kv()])
    assert loaded.hit and _rel(loaded.kv.keys, exact.keys) < 0.1 and _rel(loaded.kv.values, exact.values) < 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("case", ["missing", "damaged", "foreign"])
def test_a_bad_transform_entry_makes_the_connectors_chunks_misses_and_nothing_is_saved(indexed, case, caplog):
    _spoil_transform(indexed, case)
    side = _side(indexed)  # a new connector process: its transform comes from the store
    ids, _ = _prompt(indexed)
    with caplog.at_level(logging.WARNING):
        assert side.plan(ids, 0, 16) is None
        assert side.plan(ids, 0, 16) is None
    assert sum("no usable channel transform" in r.getMessage() for r in caplog.records) == 1  # said once
    assert side.computer.transforms.current() is None and side.computer.transforms.digest() == UNCALIBRATED
    # save-back would code the chunk in a transform no one holds: not offered, and nothing calibrated here
    assert side.saveable(ids) is None
    assert indexed.store.get(transform_key(indexed.retriever.tenant, indexed.adapter.fingerprint)) is None


def test_the_connector_reads_the_transform_an_indexer_calibrates_after_it_started(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as engine:
        side = _side(engine)
        side._refresh_s = 0.0  # re-read the catalog on every plan (2 s by default)
        assert side.plan([1, 2, 3], 0, 16) is None  # nothing indexed: no chunk, no transform yet
        assert side.computer.transforms.current() is None
        engine.index(DOCS, progress=False)  # calibrates the transform and stores chunks coded in it
        ids, stored = _prompt(engine)
        plan = side.plan(ids, 0, 16)
        assert plan is not None and [s.chunk.stored_ids for s in plan.spans] == stored
        held = engine.retriever.computer.transforms.current()
        assert held is not None and side.computer.transforms.digest() == held.digest


def test_a_worker_in_another_process_reads_the_transform_the_scheduler_keyed_with(tmp_path, llama_adapter, caplog):
    with _engine(tmp_path, llama_adapter) as engine:
        worker = _side(engine)  # its own side (another process): it looked before any transform existed
        assert worker.computer.transforms.current() is None
        engine.index(DOCS, progress=False)
        scheduler = _side(engine)
        ids, _ = _prompt(engine)
        plan = scheduler.plan(ids, 0, 16)
        held = engine.retriever.computer.transforms.current()
        assert plan is not None and held is not None and plan.transform == held.digest
        with caplog.at_level(logging.WARNING):
            worker.fused_kv(ids, plan)
        assert worker.computer.transforms.digest() == held.digest
        assert not any("vanished" in r.getMessage() for r in caplog.records)  # every chunk loaded, none recomputed
