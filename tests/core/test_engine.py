"""The engine end to end on a tiny model: index, retrieve, reuse, restart, damage, tenants, bad input."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ragkv.engine import CachedText, EngineConfig, RagKV
from ragkv.errors import ContextTooLongError
from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.selection import QueryFocusParams

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 12 + "\n\nThey are red or green. " * 8, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 10 + "\n\nSails catch the wind. " * 9, "boats"),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 11, "clocks"),
]
GEN = GenerationConfig(max_new_tokens=8)


def _engine(tmp_path: Path, adapter, **kw) -> RagKV:
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        store=("memory://", str(tmp_path / "kv")),
        **kw,
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def test_index_is_idempotent_and_answers_reuse_caches(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        first = rag.index(DOCS, progress=False)
        # identical chunk texts share one content-addressed cache entry
        assert first.chunks > 3 and first.computed + first.reused == first.chunks and first.unchanged == 0
        assert first.computed > 0
        again = rag.index(DOCS, progress=False)
        assert again.unchanged == 3 and again.computed == 0 and again.chunks == 0
        res = rag.answer("Where do apples grow?", generation=GEN)
        assert res.sources and res.sources[0].source == "mem:apples"
        s = res.stats
        assert s.cache_hits == len(res.sources) and s.prefilled_chunk_tokens == 0 and s.bytes_loaded > 0
        assert s.reused_tokens + s.recomputed_tokens == sum(len(c.token_ids) for c in res.sources)


def test_full_fusion_through_the_engine_equals_full_prefill(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, fusion=FusionConfig(method="full")) as rag:
        rag.index(DOCS, progress=False)
        chunks = rag.retrieve("boats and sails")
        reuse = rag.answer("What do sails do?", chunks=chunks, generation=GEN)
        full = rag.answer("What do sails do?", chunks=chunks, mode="full", generation=GEN)
        assert reuse.text == full.text and reuse.stats.generated_tokens == full.stats.generated_tokens
        assert full.stats.prefilled_chunk_tokens == sum(len(c.token_ids) for c in chunks)


def test_an_answer_says_when_its_recompute_target_was_capped(tmp_path, llama_adapter):
    # coverage 1.0 wants every scored token; the ratio caps it, and the stats say so (issue 36)
    capped = FusionConfig("query_focus", 0.2, QueryFocusParams(coverage=1.0))
    with _engine(tmp_path, llama_adapter, fusion=capped) as rag:
        rag.index(DOCS, progress=False)
        res = rag.answer("Where do apples grow?", generation=GEN)
        extra = res.stats.extra
        assert extra["recompute_capped"] is True and 0.2 < extra["recompute_wanted"] <= 1.0
        assert res.stats.recomputed_tokens > 0  # the cap, not naive reuse
        assert res.stats.as_dict()["recompute_capped"] is True
    with _engine(tmp_path / "fixed", llama_adapter) as rag:  # the default: a fixed share, no new keys
        rag.index(DOCS, progress=False)
        res = rag.answer("Where do apples grow?", generation=GEN)
        assert "recompute_capped" not in res.stats.extra and "recompute_wanted" not in res.stats.extra


def test_restart_keeps_index_and_caches(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)
    with _engine(tmp_path, llama_adapter) as rag:  # a new process would see the same files
        assert rag.index(DOCS, progress=False).unchanged == 3
        res = rag.answer("clocks and gears", generation=GEN)
        assert res.sources[0].source == "mem:clocks" and res.stats.cache_misses == 0


def test_damaged_entry_is_a_miss_then_recomputed(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)
        chunks = rag.retrieve("apples orchards")
        clean = rag.answer("apples?", chunks=chunks, generation=GEN)
        key = rag.retriever.computer.chunk_key(chunks[0].token_ids, rag.config.retriever.codec).storage_key
        blob = bytearray(rag.store.get(key))
        blob[len(blob) // 2] ^= 0xFF
        rag.store.invalidate(key)
        rag.store.put(key, bytes(blob))
        damaged = rag.answer("apples?", chunks=chunks, generation=GEN)
        assert damaged.stats.cache_misses == 1 and damaged.text == clean.text
        healed = rag.answer("apples?", chunks=chunks, generation=GEN)
        assert healed.stats.cache_misses == 0


def test_tenants_do_not_see_each_other(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, tenant="a") as rag:
        rag.index(DOCS[:1], progress=False)
    with _engine(tmp_path, llama_adapter, tenant="b") as rag:
        assert rag.retrieve("apples") == []
        rag.index(DOCS[1:2], progress=False)
        assert {c.source for c in rag.retrieve("apples boats", k=5)} == {"mem:boats"}


def test_unknown_chunk_text_is_computed_and_stored(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        texts = ["A chunk the index has never seen."]
        out = list(rag.generate_stream(texts, "what?", generation=GEN))
        assert out[-1][1].cache_misses == 1
        out = list(rag.generate_stream(texts, "what?", generation=GEN))
        assert out[-1][1].cache_hits == 1 and out[-1][1].prefilled_chunk_tokens == 0


def test_bad_input_gives_clear_errors(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        with pytest.raises(ValueError, match="empty"):
            rag.answer("   ")
        with pytest.raises(ValueError, match="nothing to index"):
            rag.index([])
        with pytest.raises(ContextTooLongError, match="context"):
            rag.answer("x " * 5000, chunks=[])
        empty = tmp_path / "empty.txt"
        empty.write_text("")
        with pytest.raises(ValueError, match="empty"):
            rag.index([str(empty)])
        binary = tmp_path / "blob.bin"
        binary.write_bytes(b"\x00\x01\x02" * 100)
        with pytest.raises(ValueError, match="binary"):
            rag.index([str(binary)])
        with pytest.raises(ValueError, match="mode"):
            rag.answer("hi", mode="fast", chunks=[])


def _chunk_ids(rag: RagKV) -> list[list[int]]:
    """Three different indexed chunks' token ids (identical chunk texts share one entry)."""
    rag.index(DOCS, progress=False)
    unique = dict.fromkeys(tuple(c.token_ids) for c in rag.retrieve("apples boats clocks", k=8))
    assert len(unique) >= 3
    return [list(t) for t in unique][:3]


@pytest.mark.parametrize("workers", [1, 3])
def test_loading_many_chunks_equals_loading_each(tmp_path, llama_adapter, workers):
    with _engine(tmp_path, llama_adapter) as rag:
        rag.retriever.loader.decode_workers = workers  # 3: the chunks decode side by side
        a, b, c = _chunk_ids(rag)
        # one damaged entry among hits: a miss, recomputed and stored; the others hits
        key = rag.retriever.computer.chunk_key(b, rag.config.retriever.codec).storage_key
        blob = bytearray(rag.store.get(key))
        blob[-9] ^= 0xFF
        rag.store.invalidate(key)
        rag.store.put(key, bytes(blob))
        many = rag.retriever.loader.load_many([a, b, c, b])
        # the repeat of b reuses the cache computed for its first occurrence: nothing to prefill
        assert [m.hit for m in many] == [True, False, True, True]
        one_by_one = [rag.retriever.loader.load(t) for t in (a, b, c, b)]
        assert all(o.hit for o in one_by_one)  # the damaged entry was replaced
        assert [m.nbytes for m in many] == [o.nbytes for o in one_by_one[:3]] + [0]  # the repeat reads nothing
        for i in (0, 2):  # hits: decoded from the same blobs
            assert torch.equal(many[i].kv.keys, one_by_one[i].kv.keys)
            assert torch.equal(many[i].kv.values, one_by_one[i].kv.values)
        exact = llama_adapter.prefill_kv(b, past=[rag.retriever.computer.prefix_kv()])  # the miss: computed now
        assert torch.equal(many[1].kv.keys, exact.keys) and torch.equal(many[1].kv.values, exact.values)
        assert many[3].kv is many[1].kv
        assert rag.retriever.loader.load_many([]) == []


def test_the_next_chunk_loads_while_this_one_decodes(tmp_path, llama_adapter, monkeypatch):
    """Pipelining: the last chunk's fetch may wait until the first chunk is decoded. Sequential
    loading (fetch everything, then decode) would never decode while a fetch is pending."""
    with _engine(tmp_path, llama_adapter) as rag:
        ids = _chunk_ids(rag)
        assert len(ids) >= 3
        last_key = rag.retriever.computer.chunk_key(ids[-1], rag.config.retriever.codec).storage_key
        first_decoded = threading.Event()
        waited: list[bool] = []
        get, decode = rag.store.get, rag.retriever.loader._decode

        def slow_get(key: str) -> bytes | None:
            if key == last_key:
                waited.append(first_decoded.wait(timeout=30))
            return get(key)

        def spy_decode(*args):
            out = decode(*args)
            first_decoded.set()
            return out

        monkeypatch.setattr(rag.store, "get", slow_get)
        monkeypatch.setattr(rag.retriever.loader, "_decode", spy_decode)
        loaded = rag.retriever.loader.load_many(ids)
        assert waited == [True] and all(x.hit for x in loaded)


def test_several_decode_threads_decode_chunks_side_by_side(tmp_path, llama_adapter, monkeypatch):
    """With decode_workers > 1 two chunks are in their decode at once (a barrier only two decodes
    in flight together can pass), off the query thread, and the loads equal those made with one."""
    with _engine(tmp_path, llama_adapter) as rag:
        ids = _chunk_ids(rag)
        loader = rag.retriever.loader
        loader.decode_workers = 1
        serial = loader.load_many(ids)
        both_in = threading.Barrier(2, timeout=30)
        threads: list[str] = []
        lock = threading.Lock()
        decode = loader._decode

        def spy_decode(*args):
            with lock:
                threads.append(threading.current_thread().name)
                n = len(threads)
            if n <= 2:  # the first two chunks: each waits until the other is decoding too
                both_in.wait()
            return decode(*args)

        loader.decode_workers = 2
        monkeypatch.setattr(loader, "_decode", spy_decode)
        parallel = loader.load_many(ids)
        assert len(threads) == len(ids) and len(set(threads[:2])) == 2
        assert threading.current_thread().name not in threads
        assert all(x.hit for x in parallel) and [x.nbytes for x in parallel] == [x.nbytes for x in serial]
        for s, p in zip(serial, parallel, strict=True):
            assert torch.equal(s.kv.keys, p.kv.keys) and torch.equal(s.kv.values, p.kv.values)


def test_a_decode_that_fails_fails_the_load_and_leaves_no_decode_running(tmp_path, llama_adapter, monkeypatch):
    """An error other than a damaged entry (say, out of memory) reaches the caller from a decode thread."""
    with _engine(tmp_path, llama_adapter) as rag:
        ids = _chunk_ids(rag)
        loader = rag.retriever.loader
        loader.decode_workers = 2
        running = [0]
        lock = threading.Lock()

        def failing(*args):
            with lock:
                running[0] += 1
                first = running[0] == 1
            try:
                if first:
                    raise MemoryError("no room for the chunk")
                time.sleep(0.2)  # the others still decode when the first one fails
                return None
            finally:
                with lock:
                    running[0] -= 1

        monkeypatch.setattr(loader, "_decode", failing)
        with pytest.raises(MemoryError, match="no room"):
            loader.load_many(ids)
        assert running == [0]  # the load waited for the decodes it had started
        monkeypatch.undo()
        assert all(x.hit for x in loader.load_many(ids))  # nothing was lost or left half-done


def test_four_threads_answering_at_once_match_one_thread(tmp_path, llama_adapter):
    """Regression: concurrent answers raised KeyError (the prefix LRU) and left the model in probe mode."""
    from concurrent.futures import ThreadPoolExecutor

    questions = ["Where do apples grow?", "What do sails do?", "How do clocks work?", "What colour are apples?"]
    # framework-style prompts with their own prefixes exercise the prefix LRU from every thread
    prompts = [
        [f"system {i}: answer briefly.\n", CachedText(DOCS[i % 3].text[:200]), f"\nQ: {q}\nA:"]
        for i, q in enumerate(questions)
    ]
    attn_before = llama_adapter.model.config._attn_implementation
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)

        def one(i: int) -> tuple[str, str]:
            text = rag.answer(questions[i], generation=GEN).text
            segs = "".join(d for d, _ in rag.generate_segments(prompts[i], generation=GEN))
            return text, segs

        alone = [one(i) for i in range(4)]
        for _ in range(3):
            with ThreadPoolExecutor(4) as pool:
                together = list(pool.map(one, range(4)))
            assert together == alone
    assert llama_adapter.model.config._attn_implementation == attn_before


def test_empty_index_answers_with_a_warning(tmp_path, llama_adapter, caplog):
    with _engine(tmp_path, llama_adapter) as rag, caplog.at_level("WARNING", logger="ragkv.engine"):
        stream = rag.stream("anything?", generation=GEN)
        assert stream.warning and "empty" in stream.warning and "index" in stream.warning
        list(stream)
        res = stream.result
        assert res.sources == () and res.stats.extra["warning"] == stream.warning
        assert any("empty" in r.message for r in caplog.records)
        with pytest.raises(ValueError, match="k must be"):
            rag.retrieve("apples", k=0)


def test_config_nests_component_records_and_validates_tenant(tmp_path):
    cfg = EngineConfig(data_dir=tmp_path)
    assert cfg.retriever == RetrieverConfig() and cfg.fusion == FusionConfig()
    with pytest.raises(ValueError, match="at most 256"):
        EngineConfig(data_dir=tmp_path, tenant="t" * 257)
    with pytest.raises(ValueError, match="top_k"):
        RetrieverConfig(top_k=0)
    assert "sssss" not in repr(EngineConfig(data_dir=tmp_path, store_secret=b"s" * 32))  # never logged


def test_a_fusion_method_the_engine_cannot_feed_is_refused_when_the_config_is_built(monkeypatch):
    from ragkv import selection
    from ragkv.engine import EngineConfig
    from ragkv.fusion import FusionConfig

    class Stored(selection.Strategy):  # ranks by deviation recorded at index time, as experiments/craft.py's
        name = "stored"
        wants_stored_scores = True

    monkeypatch.setitem(selection._REGISTRY, "stored", Stored)
    with pytest.raises(ValueError, match="index time.*query_focus"):
        EngineConfig(fusion=FusionConfig(method="stored"))


def test_engine_config_repr_never_shows_a_password(tmp_path):
    cfg = EngineConfig(
        data_dir=tmp_path,
        store=("memory://", "redis://:redis-pw-1@cache:6379/0?timeout=2", str(tmp_path / "kv")),
        catalog="postgresql+psycopg://ragkv:pg-pw-2@db:5432/ragkv",
        store_secret=b"mac-secret-0123456789",
    )
    shown = repr(cfg)
    for secret in ("redis-pw-1", "pg-pw-2", "mac-secret"):
        assert secret not in shown
    assert "redis://:***@cache:6379/0" in shown and "postgresql+psycopg://ragkv:***@db:5432/ragkv" in shown
    assert str(tmp_path / "kv") in shown and "tenant='default'" in shown


def test_the_engines_static_decode_answers_as_the_reference_decode(tmp_path, llama_adapter):
    from ragkv.generation import generate_ids

    prompt = "<|im_start|>user\nName three things that float.<|im_end|>\n<|im_start|>assistant\n"
    with _engine(tmp_path, llama_adapter) as rag:
        parts = list(rag.generate_segments([prompt], generation=GenerationConfig(max_new_tokens=24)))
    text, stats = "".join(d for d, _ in parts), parts[-1][1]
    want = generate_ids(llama_adapter, [], llama_adapter.encode(prompt), 24)
    assert text == llama_adapter.decode(want)
    assert stats is not None and stats.decode_weights == "model" and stats.as_dict()["decode_weights"] == "model"


def test_int8_decode_is_a_setting_the_stats_name(tmp_path, tiny_tokenizer, monkeypatch):
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    with pytest.raises(ValueError, match="decode_weights must be auto or one of"):
        EngineConfig(data_dir=tmp_path, decode_weights="int2")
    monkeypatch.setenv("RAGKV_DECODE_WEIGHTS", "int8")
    assert EngineConfig.from_env(data_dir=tmp_path).decode_weights == "int8"
    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    with _engine(tmp_path, adapter, decode_weights="int8") as rag:
        rag.index(DOCS[:1], progress=False)
        res = rag.answer("Where do apples grow?", generation=GEN)
    assert res.stats.decode_weights == "int8" and res.stats.generated_tokens > 0


def test_auto_decode_weights_are_int8_for_a_quantized_gguf_on_the_cpu(tmp_path, tiny_tokenizer):
    """The default (auto) reads a GGUF file's bits: int8 at <= 8 bits on the CPU, else the model's weights."""
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    assert EngineConfig(data_dir=tmp_path).decode_weights == "auto"
    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    for bits, want in ((4, "int8"), (8, "int8"), (16, "model"), (None, "model")):
        adapter.weight_bits = bits
        with _engine(tmp_path / str(bits), adapter) as rag:
            rag.index(DOCS[:1], progress=False)
            res = rag.answer("Where do apples grow?", generation=GEN)
            assert res.stats.decode_weights == want and rag.model_info()["decode_weights"] == want
            assert rag.model_info()["decode_weights_reason"].startswith("auto: ")


def test_an_answer_stream_resumed_on_other_threads_equals_one_read_on_one(tmp_path, llama_adapter):
    """Regression: the static decoder's buffers, made under inference mode, were written in place by a
    step run on another thread (a web framework's worker pool) outside it: RuntimeError at token 2."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = "<|im_start|>user\nName three things that float.<|im_end|>\n<|im_start|>assistant\n"
    gen = GenerationConfig(max_new_tokens=12)
    with _engine(tmp_path, llama_adapter) as rag:
        want = "".join(d for d, _ in rag.generate_segments([prompt], generation=gen))
        stream = iter(rag.generate_segments([prompt], generation=gen))
        got = []
        while True:
            with ThreadPoolExecutor(1) as pool:  # a fresh thread for every piece
                item = pool.submit(next, stream, None).result()
            if item is None:
                break
            got.append(item[0])
    assert "".join(got) == want


def test_a_tenants_engine_shares_the_heavy_parts_and_closing_it_closes_none(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS[:1], progress=False)
        other = rag.for_tenant("beta")
        assert (other.adapter, other.store, other.catalog) == (rag.adapter, rag.store, rag.catalog)
        assert other.decode_weights == rag.decode_weights
        assert other.model_lock is rag.model_lock and other.config.tenant == "beta"
        assert other.retrieve("apples") == [] and rag.retrieve("apples")  # its own index: empty
        other.close()
        assert rag.answer("Where do apples grow?", generation=GEN).text is not None  # store and catalog still open
