"""The host tier: keyed like the store, bounded in bytes, admitted off the request's path, exact hits.

A CPU has no page-locked memory, so these run the tier with ``pin=False`` (what it picks without
CUDA) and an explicit budget (a CPU model has none by default). The engine tests check the lookup
order (device tier, host tier, store), that a host hit fuses exactly as a store hit, and that
removal and unusable entries reach the tier; the CUDA tests at the end run it pinned, on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.gpu import host_tier as host_tier_mod
from ragkv.gpu.host_tier import HostTier, HostTierConfig
from ragkv.gpu.tier import DeviceTierConfig
from ragkv.types import ChunkKV
from tests.core.test_engine import DOCS, GEN, _engine

_FP = "model-a"
_TIERED = HostTierConfig(budget_bytes=64 << 20)


def _kv(tokens: int, fp: str = _FP, dtype: torch.dtype = torch.float32) -> ChunkKV:
    k = torch.randn(2, 2, tokens, 4).to(dtype)
    return ChunkKV(k, k.clone(), torch.arange(tokens), fp)


def _bytes(tokens: int) -> int:
    return 2 * 2 * 2 * tokens * 4 * 4  # K and V, 2 layers, 2 heads, 4 dims, fp32


def _get(tier: HostTier, key: str, tokens: int, **kw) -> ChunkKV | None:
    return tier.get(key, fingerprint=kw.get("fp", _FP), dtype=kw.get("dtype", torch.float32), num_tokens=tokens)


def _distinct(rag: RagKV, question: str) -> list[list[int]]:
    """The token ids of the chunks retrieved for ``question``, each once (equal texts share an entry)."""
    return [list(t) for t in dict.fromkeys(tuple(c.token_ids) for c in rag.retrieve(question))]


class _Gate:
    """Holds the tier's worker inside its copy until opened: what is decided meanwhile is off its path."""

    def __init__(self, tier: HostTier) -> None:
        self.entered, self.open = threading.Event(), threading.Event()
        self.threads: list[str] = []
        real = tier._copy

        def copy(kv, ready):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.open.wait(10), "the test never opened the gate"
            return real(kv, ready)

        tier._copy = copy  # type: ignore[method-assign]


# ---- the tier --------------------------------------------------------------------------------
def test_a_hit_is_a_copy_of_the_entry_and_a_foreign_one_is_a_miss_that_goes():
    tier = HostTier(10 * _bytes(8), pin=False)
    kv = _kv(8)
    assert tier.put("k1", kv, cost_s=0.01)
    got = _get(tier, "k1", 8)
    assert got is not None and got.keys is not kv.keys  # a copy in the tier's own memory
    assert torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)
    assert torch.equal(got.positions, kv.positions) and got.model_fingerprint == _FP
    assert _get(tier, "k1", 8, fp="model-b") is None and "k1" not in tier  # another model: a miss; it goes
    tier.put("k2", _kv(8), 0.01)
    assert _get(tier, "k2", 8, dtype=torch.float16) is None and "k2" not in tier  # another dtype
    tier.put("k3", _kv(8), 0.01)
    assert _get(tier, "k3", 9) is None and "k3" not in tier  # another length
    assert _get(tier, "nothing", 8) is None
    assert tier.stats()["hits"] == 1 and tier.stats()["misses"] == 4
    tier.put("k4", _kv(8, dtype=torch.float16), 0.01)  # kept in the dtype it came in (raw: fp16)
    held = _get(tier, "k4", 8, dtype=torch.float16)
    assert held is not None and held.keys.dtype == torch.float16


def test_eviction_is_greedy_dual_size_in_exact_order():
    tier = HostTier(3 * _bytes(8), pin=False)
    for key in ("a", "b", "c"):
        tier.put(key, _kv(8), cost_s=0.01)
    _get(tier, "a", 8)  # a is now the most recent
    assert tier.keys() == ["b", "c", "a"]
    tier.put("d", _kv(8), cost_s=0.01)
    assert tier.keys() == ["c", "a", "d"] and tier.stats()["evictions"] == 1
    tier.put("slow", _kv(8), cost_s=1.0)  # slow to load again: outlives cheaper ones used as recently
    tier.put("e", _kv(8), cost_s=0.01)
    assert tier.keys() == ["d", "e", "slow"]


def test_the_budget_counts_what_memory_is_held_and_an_entry_too_big_is_refused():
    tier = HostTier(2 * _bytes(8), pin=False)
    assert not tier.put("huge", _kv(24), 1.0) and not tier.offer("huge", _kv(24), 1.0)
    assert tier.stats()["refused"] == 2 and tier.stats()["entries"] == 0
    for i in range(5):
        tier.put(f"k{i}", _kv(8), 0.01)
        assert tier.stats()["bytes"] <= tier.budget_bytes
    # an entry costs its arena blocks: each tensor rounded up to 512 bytes, not to a power of two
    assert HostTier(1 << 30, pin=False)._footprint(_kv(3)) == 2 * 512  # 2*2*3*4 fp32 = 192 bytes -> 512
    assert HostTier(1 << 30, pin=False)._footprint(_kv(40)) == 2 * 2560  # 2,560 bytes each: exact


def test_entries_live_in_the_arena_and_an_evicted_one_a_request_reads_keeps_its_memory():
    tier = HostTier(3 * _bytes(8), pin=False)
    kv = {k: _kv(8) for k in "abcd"}
    for key in "abc":
        assert tier.put(key, kv[key], 0.01)
    held = _get(tier, "a", 8)  # a request reads a
    assert held is not None
    assert tier.stats()["arena_bytes"] == 3 * _bytes(8) and tier.stats()["arena_block_bytes"] == 3 * _bytes(8)
    tier._entries["a"].priority = -1.0  # a goes first (the request still holds it)
    # no free block: a goes (a request still reads it: nothing is freed), then b, whose room d takes
    assert tier.put("d", kv["d"], 0.01)
    assert "a" not in tier and "d" in tier and tier.stats()["evictions"] == 2
    assert torch.equal(held.keys, kv["a"].keys) and torch.equal(held.values, kv["a"].values)  # never overwritten
    del held  # the request is done: a's blocks come back
    assert tier.put("e", _kv(8), 0.01) and tier.stats()["evictions"] == 2
    assert tier.stats()["arena_block_bytes"] == 3 * _bytes(8)
    for key in ("c", "d"):
        got = _get(tier, key, 8)
        assert got is not None and torch.equal(got.keys, kv[key].keys)


def test_with_every_block_still_read_an_admission_gives_up_without_emptying_the_tier():
    tier = HostTier(6 * _bytes(8), pin=False)
    readers = []
    for key in "abcdef":
        assert tier.put(key, _kv(8), 0.01)
        readers.append(_get(tier, key, 8))  # every entry is being read
    with pytest.raises(MemoryError, match="still being read"):
        tier.put("g", _kv(8), 0.01)
    assert 0 < tier.stats()["evictions"] <= 5 and tier.stats()["entries"] >= 1
    del readers
    assert tier.put("g", _kv(8), 0.01)  # once read, the evicted entries' blocks are free again


def test_an_offer_is_copied_by_the_worker_while_the_caller_goes_on():
    tier = HostTier(10 * _bytes(8), pin=False)
    gate = _Gate(tier)
    kv = _kv(8)
    assert tier.offer("k", kv, 0.01)  # returns with the copy not made
    assert gate.entered.wait(10)
    assert "k" not in tier and tier.stats()["queued"] == 1
    assert not tier.offer("k", kv, 0.01)  # queued already: not twice
    gate.open.set()
    tier.drain()
    got = _get(tier, "k", 8)
    assert got is not None and torch.equal(got.keys, kv.keys) and tier.stats()["queued"] == 0
    assert gate.threads == ["ragkv-host-tier"]  # never the caller's thread


def test_a_full_queue_drops_admissions_without_error():
    tier = HostTier(10 * _bytes(8), pin=False, queue_size=1)
    gate = _Gate(tier)
    assert tier.offer("a", _kv(8), 0.01)
    assert gate.entered.wait(10)  # the worker holds a; the queue has room for one more
    assert tier.offer("b", _kv(8), 0.01)
    assert not tier.offer("c", _kv(8), 0.01)  # full: dropped, the chunk stays in the store
    assert tier.stats()["dropped"] == 1
    gate.open.set()
    tier.drain()
    assert sorted(tier.keys()) == ["a", "b"]


def test_a_discard_cancels_an_admission_queued_or_being_copied():
    tier = HostTier(10 * _bytes(8), pin=False)
    gate = _Gate(tier)
    tier.offer("copying", _kv(8), 0.01)
    assert gate.entered.wait(10)
    tier.offer("queued", _kv(8), 0.01)
    tier.offer("kept", _kv(8), 0.01)
    assert tier.discard("copying") and tier.discard("queued")  # e.g. their document was removed
    gate.open.set()
    tier.drain()
    assert tier.keys() == ["kept"]
    tier.offer("late", _kv(8), 0.01)
    tier.clear()  # cancels what waits too
    tier.drain()
    assert tier.keys() == [] and tier.stats()["queued"] == 0


def test_a_failed_copy_is_a_missed_admission_and_the_worker_goes_on(caplog):
    tier = HostTier(10 * _bytes(8), pin=False)
    real, calls = tier._copy, []

    def copy(kv, ready):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no pinned memory left")
        return real(kv, ready)

    tier._copy = copy  # type: ignore[method-assign]
    tier.offer("a", _kv(8), 0.01)
    tier.offer("b", _kv(8), 0.01)
    tier.drain()
    assert tier.keys() == ["b"] and tier.stats()["refused"] == 1 and tier.stats()["queued"] == 0
    assert "could not keep a" in caplog.text


def test_the_worker_ends_when_idle_and_starts_again(monkeypatch):
    monkeypatch.setattr(host_tier_mod, "_IDLE_S", 0.01)
    tier = HostTier(10 * _bytes(8), pin=False)
    tier.offer("a", _kv(8), 0.01)
    tier.drain()
    worker = tier._worker
    if worker is not None:
        worker.join(5)
    assert tier._worker is None
    tier.offer("b", _kv(8), 0.01)
    tier.drain()
    assert sorted(tier.keys()) == ["a", "b"]


def test_the_waiting_worker_does_not_keep_its_tier_alive():
    """A worker whose thread held the tier freed the tier's tensors when it ended; at interpreter
    exit that aborted the process. The tier goes with its last user's reference, the worker after."""
    import gc
    import weakref

    tier = HostTier(10 * _bytes(8), pin=False)
    tier.offer("a", _kv(8), 0.01)
    tier.drain()
    worker, ref = tier._worker, weakref.ref(tier)
    assert worker is not None and worker.is_alive()  # waiting for the next admission
    del tier
    gc.collect()
    assert ref() is None  # freed here, on the thread that let go of it
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_the_config_is_off_for_a_cpu_model_and_capped_on_a_gpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert HostTierConfig().budget_for(cpu) == 0  # host memory has memory:// already
    assert HostTierConfig(budget_bytes=123).budget_for(cpu) == 123
    monkeypatch.setattr(host_tier_mod, "available_memory", lambda: 100 << 30)
    assert HostTierConfig().budget_for(cuda) == 16 << 30  # a quarter of 100 GiB, capped at 16
    assert HostTierConfig(fraction=0.1).budget_for(cuda) == int(0.1 * (100 << 30))
    assert HostTierConfig(budget_bytes=0).budget_for(cuda) == 0  # off
    for bad, match in (({"budget_bytes": -1}, "budget_bytes"), ({"fraction": 1.0}, "fraction"),
                       ({"max_bytes": -1}, "max_bytes"), ({"queue_size": 0}, "queue_size")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            HostTierConfig(**bad)
    monkeypatch.undo()
    assert host_tier_mod.available_memory() > 0  # this machine's


# ---- through the loader and the engine -------------------------------------------------------
def test_lookup_order_is_device_tier_then_host_tier_then_store(tmp_path, llama_adapter):
    question = "Where do apples grow?"
    tiers = {"device_tier": DeviceTierConfig(budget_bytes=64 << 20), "host_tier": _TIERED}
    with _engine(tmp_path, llama_adapter, **tiers) as rag:
        device, host = rag.device_tier, rag.host_tier
        assert device is not None and host is not None
        rag.index(DOCS[:1], progress=False)
        segments = _distinct(rag, question)
        loader = rag.retriever.loader
        stored = loader.load_many(segments)  # store hits: admitted to both tiers
        host.drain()
        on_device = loader.load_many(segments)  # device hits: the host tier is not asked
        assert host.stats()["hits"] == 0 and host.stats()["entries"] == len(segments)
        device.clear()
        answer = rag.answer(question, generation=GEN)  # host hits, admitted to the device tier again
        again = loader.load_many(segments)
    assert all(x.hit and x.nbytes > 0 and not x.device and not x.host for x in stored)
    assert all(x.device and not x.host for x in on_device)
    n = len(answer.sources)
    assert answer.stats.extra["host_hits"] == answer.stats.cache_hits == n and "device_hits" not in answer.stats.extra
    assert answer.stats.bytes_loaded == 0  # nothing read from the store
    assert all(x.device for x in again)


def test_a_host_hit_fuses_exactly_as_a_store_hit(tmp_path, llama_adapter):
    a = llama_adapter
    with _engine(tmp_path, a, host_tier=_TIERED) as rag:
        assert rag.host_tier is not None
        rag.index(DOCS[:1], progress=False)
        segments = _distinct(rag, "Where do apples grow?")
        loader = rag.retriever.loader
        from_store = loader.load_many(segments)
        rag.host_tier.drain()
        from_host = loader.load_many(segments)
        prefix = loader.computer.prefix_kv()
        other = rag.for_tenant("other")  # the same tier, but its keys digest the tenant: none of these
        assert other.host_tier is rag.host_tier
        assert not any(x.host or x.hit for x in other.retriever.loader.load_many(segments))
    assert all(s.hit and not s.host and s.nbytes > 0 for s in from_store)
    assert all(h.hit and h.host and h.nbytes == 0 for h in from_host)
    suffix = a.encode("Where do apples grow?")
    logits = []
    for loaded in (from_store, from_host):
        inp = FusionInput(prefix, [x.kv for x in loaded], segments, suffix)
        fused = fuse(a, inp, FusionConfig(), prefill_suffix=True)
        assert fused.suffix_logits is not None
        logits.append(fused.suffix_logits)
    assert torch.equal(logits[0], logits[1])


def test_remove_reaches_the_host_tier_and_a_chunk_read_as_it_goes_is_not_kept(tmp_path, llama_adapter):
    from ragkv.digests import tokens_digest

    with _engine(tmp_path, llama_adapter, host_tier=_TIERED) as rag:
        tier, loader = rag.host_tier, rag.retriever.loader
        assert tier is not None
        rag.index(DOCS[:2], progress=False)
        key, codec = rag.retriever.computer.chunk_key, rag.retriever.config.codec
        # boats: read after its removal marked its chunks but before it deleted anything: never kept
        boats = [list(c.token_ids) for c in rag.retrieve("What do sails do?") if c.source == "mem:boats"]
        assert boats
        rag.catalog.mark_removed("mem:boats", rag.config.tenant, [tokens_digest(ids) for ids in boats])
        assert all(x.hit for x in loader.load_many(boats))
        tier.drain()
        assert not {key(ids, codec).storage_key for ids in boats} & set(tier.keys())
        # apples: kept, then removed: gone from the tier
        apples = [list(c.token_ids) for c in rag.retrieve("Where do apples grow?") if c.source == "mem:apples"]
        loader.load_many(apples)
        tier.drain()
        kept = {key(ids, codec).storage_key for ids in apples}
        assert kept and kept <= set(tier.keys())
        rag.remove("mem:apples")
        assert not kept & set(tier.keys())


def test_an_unusable_entry_cancels_the_host_copy_and_a_recomputed_chunk_is_never_kept(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, host_tier=_TIERED) as rag:
        tier = rag.host_tier
        assert tier is not None
        rag.index(DOCS[:1], progress=False)
        chunks = rag.retrieve("apples orchards")
        ids = list(chunks[0].token_ids)
        key = rag.retriever.computer.chunk_key(ids, rag.config.retriever.codec).storage_key
        gate = _Gate(tier)
        first = rag.retriever.loader.load(ids)  # a store hit, offered; the load returns before the copy
        assert first.hit and gate.entered.wait(10) and key not in tier
        blob = bytearray(rag.store.get(key))
        blob[len(blob) // 2] ^= 0xFF
        rag.store.invalidate(key)
        rag.store.put(key, bytes(blob))
        damaged = rag.retriever.loader.load(ids)  # not in the tier yet: read, found unusable, recomputed
        assert not damaged.hit
        gate.open.set()
        tier.drain()
        assert key not in tier  # the copy on its way was cancelled; the recomputed chunk was not offered
        healed = rag.retriever.loader.load(ids)  # the recomputed entry, stored: a store hit, kept
        tier.drain()
        assert healed.hit and key in tier


def test_a_cpu_engine_has_no_host_tier_by_default(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        assert rag.host_tier is None and rag.retriever.loader.host_tier is None
    assert EngineConfig(data_dir=tmp_path).host_tier == HostTierConfig()


# ---- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", ["raw", "cachegen"])
def test_on_cuda_a_host_hit_answers_as_a_store_hit(tmp_path, tiny_tokenizer, level):
    """raw: kept as the fp16 the loader stages, crossing by DMA from pinned memory; cachegen: decoded
    on the device, copied back by the worker in the model's dtype. Host hits refill the device tier."""
    from ragkv.model import load_model
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    retr = RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=CodecSpec(level, 0))
    question = "Where do apples grow?"

    def engine(name: str, device: int, host: int) -> RagKV:
        cfg = EngineConfig(
            data_dir=tmp_path / name,
            retriever=retr,
            store=("memory://",),
            device_tier=DeviceTierConfig(budget_bytes=device),
            host_tier=HostTierConfig(budget_bytes=host),
        )
        return RagKV(cfg, adapter=a, embedder=HashingEmbedder(dim=64))

    with engine("plain", 0, 0) as rag:
        assert rag.host_tier is None
        rag.index(DOCS, progress=False)
        want = rag.answer(question, generation=GEN)
    with engine("tiers", 256 << 20, 256 << 20) as rag:
        assert rag.device_tier is not None and rag.host_tier is not None and rag.host_tier.pin
        rag.index(DOCS, progress=False)
        answers = [rag.answer(question, generation=GEN)]  # store hits
        rag.host_tier.drain()
        rag.device_tier.clear()
        answers.append(rag.answer(question, generation=GEN))  # host hits (the device tier emptied)
        answers.append(rag.answer(question, generation=GEN))  # device hits, filled from the host hits
        entries = [rag.host_tier.get(k, fingerprint=a.fingerprint, dtype=torch.float16 if level == "raw" else a.dtype,
                                     num_tokens=len(c.token_ids))
                   for c in answers[0].sources
                   for k in [rag.retriever.computer.chunk_key(c.token_ids, retr.codec).storage_key]]  # fmt: skip
    stored, host, device = answers
    assert want.text == stored.text == host.text == device.text
    assert host.stats.extra.get("host_hits") == host.stats.cache_hits > 0 and host.stats.bytes_loaded == 0
    assert device.stats.extra.get("device_hits") == device.stats.cache_hits > 0
    assert entries and all(kv is not None and kv.keys.is_pinned() and kv.values.is_pinned() for kv in entries)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_host_hits_fuse_exactly_as_store_hits(tmp_path, tiny_tokenizer):
    """Raw chunks of a bf16 model: store hits (fp16 views, staged through slabs) against host hits
    (the same fp16 in pinned memory, crossing straight by DMA): the suffix logits are equal."""
    from ragkv.model import load_model
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    retr = RetrieverConfig(top_k=3, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=CodecSpec("raw", 0))
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=retr,
        store=("memory://",),
        device_tier=DeviceTierConfig(budget_bytes=0),
        host_tier=HostTierConfig(budget_bytes=256 << 20),
    )
    with RagKV(cfg, adapter=a, embedder=HashingEmbedder(dim=64)) as rag:
        assert rag.host_tier is not None
        rag.index(DOCS, progress=False)
        segments = _distinct(rag, "Where do apples grow?")
        loader = rag.retriever.loader
        from_store = loader.load_many(segments)
        rag.host_tier.drain()
        from_host = loader.load_many(segments)
        prefix = loader.computer.prefix_kv()
    assert all(s.hit and not s.host and not s.kv.keys.is_pinned() for s in from_store)
    assert all(h.host and h.kv.keys.is_pinned() and h.kv.keys.dtype == torch.float16 for h in from_host)
    suffix = a.encode("Where do apples grow?")
    logits = []
    for loaded in (from_store, from_host):
        fused = fuse(a, FusionInput(prefix, [x.kv for x in loaded], segments, suffix), prefill_suffix=True)
        assert fused.suffix_logits is not None
        logits.append(fused.suffix_logits)
    torch.cuda.synchronize()
    assert torch.equal(logits[0], logits[1])
