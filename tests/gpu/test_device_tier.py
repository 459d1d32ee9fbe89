"""The device tier: keyed like the store, bounded in bytes, GreedyDual-Size eviction, exact hits.

The tier is device-agnostic, so these run on the CPU with an explicit budget (a CPU model has none
by default); the engine tests check that a tier hit answers exactly as a store hit does and that
``remove`` reaches the tier.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import ragkv.fusion
from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import FusionConfig
from ragkv.gpu.tier import DeviceTier, DeviceTierConfig, release
from ragkv.types import ChunkKV
from tests.core.test_engine import DOCS, GEN, _engine

_FP = "model-a"


def _kv(tokens: int, fp: str = _FP, dtype: torch.dtype = torch.float32) -> ChunkKV:
    k = torch.randn(2, 2, tokens, 4, dtype=dtype)
    return ChunkKV(k, k.clone(), torch.arange(tokens), fp)


def _bytes(tokens: int) -> int:
    return 2 * 2 * 2 * tokens * 4 * 4  # K and V, 2 layers, 2 heads, 4 dims, fp32


def _get(tier: DeviceTier, key: str, tokens: int, **kw) -> ChunkKV | None:
    return tier.get(key, fingerprint=kw.get("fp", _FP), dtype=kw.get("dtype", torch.float32), num_tokens=tokens)


def test_a_hit_is_the_entry_put_and_a_foreign_one_is_a_miss_that_goes():
    tier = DeviceTier(10 * _bytes(8), "cpu")
    kv = _kv(8)
    assert tier.put("k1", kv, cost_s=0.01)
    assert _get(tier, "k1", 8) is kv
    assert _get(tier, "k1", 8, fp="model-b") is None  # another model: a miss, and the entry goes
    assert "k1" not in tier
    tier.put("k2", _kv(8), 0.01)
    assert _get(tier, "k2", 8, dtype=torch.bfloat16) is None and "k2" not in tier  # another dtype
    tier.put("k3", _kv(8), 0.01)
    assert _get(tier, "k3", 9) is None and "k3" not in tier  # another length
    assert _get(tier, "nothing", 8) is None
    with pytest.raises(ValueError, match="device tier on cpu"):
        meta = torch.zeros(2, 2, 1, 4, device="meta")
        tier.put("k4", ChunkKV(meta, meta, torch.arange(1), _FP), 0.01)


def test_eviction_is_least_recent_among_equal_costs_in_exact_order():
    tier = DeviceTier(3 * _bytes(8), "cpu")
    for key in ("a", "b", "c"):
        tier.put(key, _kv(8), cost_s=0.01)
    _get(tier, "a", 8)  # a is now the most recent
    assert tier.keys() == ["b", "c", "a"]
    tier.put("d", _kv(8), cost_s=0.01)
    assert tier.keys() == ["c", "a", "d"] and tier.stats()["evictions"] == 1


def test_a_costly_entry_outlives_a_cheap_one_used_as_recently():
    tier = DeviceTier(2 * _bytes(8), "cpu")
    tier.put("slow", _kv(8), cost_s=1.0)  # e.g. read from a remote tier and entropy-decoded
    tier.put("cheap", _kv(8), cost_s=0.001)
    tier.put("new", _kv(8), cost_s=0.001)
    assert "slow" in tier and "cheap" not in tier and "new" in tier


def test_the_budget_bounds_the_bytes_and_an_entry_too_big_is_refused():
    tier = DeviceTier(2 * _bytes(8), "cpu")
    assert not tier.put("huge", _kv(24), 1.0)
    assert tier.stats()["refused"] == 1 and tier.stats()["entries"] == 0
    for i in range(5):
        tier.put(f"k{i}", _kv(8), 0.01)
        assert tier.stats()["bytes"] <= tier.budget_bytes


def test_a_reservation_serves_only_once_filled_and_frees_itself_if_dropped():
    tier = DeviceTier(2 * _bytes(8), "cpu")
    like = _kv(8)
    sink = tier.reserve("r", like, torch.float32, 0.01)
    assert sink is not None and tier.stats()["pending_bytes"] == _bytes(8)
    assert _get(tier, "r", 8) is None  # not filled yet
    sink.keys.copy_(like.keys)
    sink.values.copy_(like.values)
    sink.on_filled()
    got = _get(tier, "r", 8)
    assert got is not None and torch.equal(got.keys, like.keys) and tier.stats()["pending_bytes"] == 0
    dropped = tier.reserve("s", _kv(8), torch.float32, 0.01)
    assert dropped is not None and tier.stats()["pending_bytes"] == _bytes(8)
    del dropped
    gc.collect()
    assert tier.stats()["pending_bytes"] == 0 and "s" not in tier


def test_a_sink_collected_while_its_tier_is_locked_frees_its_reservation_later_without_a_deadlock():
    # the cycle collector may collect a sink (say, in an exception's traceback) at any allocation,
    # the tier's lock held by the very thread it runs on
    tier = DeviceTier(2 * _bytes(8), "cpu")
    sink = tier.reserve("r", _kv(8), torch.float32, 0.01)
    assert sink is not None
    done = threading.Event()

    def collect_inside_the_lock() -> None:
        nonlocal sink
        with tier._lock:
            sink = None  # its finalizer runs here, the lock held by this thread
        done.set()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    assert done.wait(5), "the finalizer waited for a lock its own thread held"
    assert tier.stats()["pending_bytes"] == 0  # closed at the next use of the tier
    again = tier.reserve("r", _kv(8), torch.float32, 0.01)
    assert again is not None  # the key is free again


def test_a_discard_while_a_reservation_fills_keeps_it_out():
    # a removal's discard can land between the loader's removal check and the sink's filling: the
    # filled sink must not become an entry (a removed document's chunk served again)
    tier = DeviceTier(2 * _bytes(8), "cpu")
    like = _kv(8)
    sink = tier.reserve("r", like, torch.float32, 0.01)
    assert sink is not None
    assert tier.reserve("r", like, torch.float32, 0.01) is None  # one reservation per key
    assert tier.discard("r") and tier.stats()["pending_bytes"] == 0
    sink.keys.copy_(like.keys)
    sink.values.copy_(like.values)
    sink.on_filled()
    assert _get(tier, "r", 8) is None and "r" not in tier and tier.stats()["pending_bytes"] == 0
    again = tier.reserve("r", like, torch.float32, 0.01)  # a later load may admit it anew
    assert again is not None
    again.on_filled()
    assert "r" in tier


def test_release_empties_the_tiers_of_a_device():
    tier = DeviceTier(4 * _bytes(8), "cpu")
    tier.put("a", _kv(8), 0.01)
    assert release(torch.device("cpu")) >= _bytes(8)
    assert tier.stats()["entries"] == 0


def test_the_config_is_off_on_a_cpu_by_default_and_checks_its_numbers():
    assert DeviceTierConfig().budget_for(torch.device("cpu")) == 0
    assert DeviceTierConfig(budget_bytes=123).budget_for(torch.device("cpu")) == 123
    with pytest.raises(ValueError, match="budget_bytes"):
        DeviceTierConfig(budget_bytes=-1)
    with pytest.raises(ValueError, match="fraction"):
        DeviceTierConfig(fraction=1.5)


# ---- through the engine -------------------------------------------------------------------------
def test_device_hits_answer_exactly_as_store_hits_and_read_nothing(tmp_path, llama_adapter):
    question = "Where do apples grow?"
    with _engine(tmp_path / "plain", llama_adapter) as rag:
        rag.index(DOCS, progress=False)
        want = rag.answer(question, generation=GEN)
    tiered = DeviceTierConfig(budget_bytes=64 << 20)
    with _engine(tmp_path / "tier", llama_adapter, device_tier=tiered) as rag:
        rag.index(DOCS, progress=False)
        first = rag.answer(question, generation=GEN)  # store hits, admitted to the tier
        second = rag.answer(question, generation=GEN)  # device hits
        assert rag.device_tier is not None
        held = rag.device_tier.stats()
    assert first.text == want.text == second.text
    assert "device_hits" not in first.stats.extra and first.stats.bytes_loaded > 0
    assert second.stats.extra["device_hits"] == second.stats.cache_hits == len(second.sources)
    assert second.stats.bytes_loaded == 0 and held["entries"] >= len(second.sources)


def test_remove_reaches_the_device_tier(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, device_tier=DeviceTierConfig(budget_bytes=64 << 20)) as rag:
        rag.index(DOCS, progress=False)
        res = rag.answer("Where do apples grow?", generation=GEN)
        assert rag.device_tier is not None
        before = set(rag.device_tier.keys())
        assert before
        rag.remove("mem:apples")
        after = set(rag.device_tier.keys())
        key, codec = rag.retriever.computer.chunk_key, rag.retriever.config.codec
        keys = {key(c.token_ids, codec).storage_key for c in res.sources if c.source == "mem:apples"}
        assert keys and keys <= before and not keys & after


def test_a_chunk_read_as_its_document_is_removed_is_not_kept(tmp_path, llama_adapter):
    """A hit read just before its document's removal discarded the tier's copy: not admitted."""
    from ragkv.digests import tokens_digest

    with _engine(tmp_path, llama_adapter, device_tier=DeviceTierConfig(budget_bytes=64 << 20)) as rag:
        rag.index(DOCS, progress=False)
        chunks = rag.retrieve("Where do apples grow?")
        apples = [c for c in chunks if c.source == "mem:apples"]
        assert apples
        # the removal has marked the chunks but not yet deleted their blobs
        rag.catalog.mark_removed("mem:apples", rag.config.tenant, [tokens_digest(c.token_ids) for c in apples])
        rag.answer("Where do apples grow?", chunks=chunks, generation=GEN)
        assert rag.device_tier is not None
        spec = rag.retriever.config.codec
        keys = {rag.retriever.computer.chunk_key(c.token_ids, spec).storage_key for c in apples}
        assert not keys & set(rag.device_tier.keys())


def test_a_cpu_engine_has_no_device_tier_by_default(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        assert rag.device_tier is None
    assert EngineConfig(data_dir=tmp_path).device_tier == DeviceTierConfig()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", ["raw", "cachegen"])
def test_on_cuda_a_device_hit_answers_as_a_store_hit(tmp_path, tiny_tokenizer, level):
    """raw: staged from the host through pinned slabs, the tier filled by a sink; cachegen: decoded
    onto the device and kept as it is. Either way the third answer (device hits) is the first's."""
    from ragkv.model import load_model
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    retr = RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=CodecSpec(level, 0))
    answers = []
    for name, tier in (("plain", DeviceTierConfig(budget_bytes=0)), ("tier", DeviceTierConfig(budget_bytes=256 << 20))):
        cfg = EngineConfig(data_dir=tmp_path / name, retriever=retr, store=("memory://",), device_tier=tier)
        with RagKV(cfg, adapter=a, embedder=HashingEmbedder(dim=64)) as rag:
            rag.index(DOCS, progress=False)
            answers += [rag.answer("Where do apples grow?", generation=GEN) for _ in range(2)]
    plain, _, first, second = answers
    assert plain.text == first.text == second.text
    assert second.stats.extra.get("device_hits") == second.stats.cache_hits > 0


def _fail_third_layer(adapter, monkeypatch) -> list[int]:
    """Make the recompute's third decoder layer (and only it) run out of device memory; the layers so far.
    Injected where fusion runs a layer (``ragkv.fusion._run_layer``): the model's layers or, on a
    GPU, their CUDA graphs."""
    real, calls = ragkv.fusion._run_layer, [0]

    def failing_once(*args, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, **kw)

    monkeypatch.setattr(ragkv.fusion, "_run_layer", failing_once)
    return calls


def test_out_of_device_memory_in_a_fused_prefill_empties_the_tier_and_runs_it_once_more(
    tmp_path, llama_adapter, monkeypatch, caplog
):
    """An out-of-memory error mid-pass (injected in a decoder layer of the recompute) empties the
    device tier and runs the pass once more: the same answer, the request's own device hits still
    used. A second failure reaches the caller, and the engine goes on."""
    question = "Where do apples grow?"
    with _engine(tmp_path, llama_adapter, device_tier=DeviceTierConfig(budget_bytes=64 << 20)) as rag:
        rag.index(DOCS, progress=False)
        want = rag.answer(question, generation=GEN)  # store hits, admitted to the tier
        tier = rag.device_tier
        assert tier is not None and tier.stats()["entries"] > 0
        calls = _fail_third_layer(llama_adapter, monkeypatch)
        learned = rag.load_estimates.fusion_fixed.samples
        with caplog.at_level("WARNING", logger="ragkv.answering"):
            got = rag.answer(question, generation=GEN)
        assert rag.load_estimates.fusion_fixed.samples == learned  # a pass run twice teaches the planner nothing
        assert got.text == want.text and calls[0] > 3
        assert got.stats.extra["device_hits"] == got.stats.cache_hits > 0  # loaded before the failure, still used
        assert tier.stats()["entries"] == 0 and "retrying once" in caplog.text

        def failing(*args, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory (injected, every time)")

        monkeypatch.setattr(ragkv.fusion, "_run_layer", failing)
        with pytest.raises(torch.OutOfMemoryError, match="every time"):
            rag.answer(question, generation=GEN)
        monkeypatch.undo()
        assert rag.answer(question, generation=GEN).text == want.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_pass_retried_out_of_memory_drops_its_tier_admissions(tmp_path, tiny_tokenizer, monkeypatch):
    """raw chunks staged from the host fill device-tier sinks as they land; a pass that runs out of
    memory mid-way is run once more without them: the answer is the plain one, no half-filled entry
    is ever served, and the next answer admits the chunks as usual."""
    from ragkv.model import load_model
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    retr = RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=CodecSpec("raw", 0))
    question = "Where do apples grow?"
    # no question probe (it would make every layer ready first): the failure comes while staging
    blend = FusionConfig(method="blend")
    cfg = EngineConfig(data_dir=tmp_path / "plain", retriever=retr, store=("memory://",), fusion=blend)
    with RagKV(_with_tier(cfg, 0), adapter=a, embedder=HashingEmbedder(dim=64)) as rag:
        rag.index(DOCS, progress=False)
        want = rag.answer(question, generation=GEN)
    cfg = EngineConfig(data_dir=tmp_path / "tier", retriever=retr, store=("memory://",), fusion=blend)
    with RagKV(_with_tier(cfg, 256 << 20), adapter=a, embedder=HashingEmbedder(dim=64)) as rag:
        rag.index(DOCS, progress=False)
        _fail_third_layer(a, monkeypatch)
        first = rag.answer(question, generation=GEN)
        monkeypatch.undo()
        gc.collect()
        tier = rag.device_tier
        assert tier is not None and first.text == want.text
        assert tier.stats()["entries"] == 0 and tier.stats()["pending_bytes"] == 0
        second, third = (rag.answer(question, generation=GEN) for _ in range(2))
    assert second.text == third.text == want.text
    assert "device_hits" not in second.stats.extra and third.stats.extra["device_hits"] == third.stats.cache_hits > 0


def _with_tier(cfg: EngineConfig, budget: int) -> EngineConfig:
    """``cfg`` with a device tier of ``budget`` bytes (0: none)."""
    from dataclasses import replace

    return replace(cfg, device_tier=DeviceTierConfig(budget_bytes=budget))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_reader_on_another_stream_waits_for_the_entry_writes(monkeypatch):
    # an entry written on one request's stream, read by a request on another stream of its own:
    # the reader waits for the writes (tests/gpu/test_stream_safety.py checks the rule on the CPU)
    tier = DeviceTier(1 << 24, torch.device("cuda", torch.cuda.current_device()))  # as tensors say it

    def read_after_write() -> bool:
        writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(reader):  # made before the writer sleeps: the read allocates nothing
            out = torch.empty(2, 2, 64, 16, device="cuda")
        with torch.cuda.stream(writer):
            keys = torch.zeros(2, 2, 64, 16, device="cuda")
            values = torch.zeros_like(keys)
            torch.cuda._sleep(200_000_000)  # the writer busy for about 0.1 s
            keys.fill_(1.0)
            values.fill_(2.0)
            assert tier.put("k", ChunkKV(keys, values, torch.arange(64), "fp"), 0.1)
        with torch.cuda.stream(reader):
            got = tier.get("k", fingerprint="fp", dtype=torch.float32, num_tokens=64)
            assert got is not None
            out.copy_(got.keys)
        torch.cuda.synchronize()
        tier.discard("k")
        return bool((out == 1).all())

    with monkeypatch.context() as m:  # the control: readers not ordered after the writes
        m.setattr(DeviceTier, "_served", lambda self, entry: None)
        reproduced = not read_after_write()
    assert read_after_write()
    if not reproduced:
        pytest.skip("the reader read right, but without the wait it did too on this device: the test proved nothing")
