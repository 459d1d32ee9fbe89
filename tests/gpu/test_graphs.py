"""ragkv.gpu.graphs: the question probe's layers replayed from static buffers equal the eager probe.

On the CPU the replays are the functions run again (``RAGKV_PROBE_GRAPHS=eager``): the buffers,
padding and order are the CUDA path's, and every replay is checked against its capture
(tests/gpu/graph_safety.py: the same ATen calls on the same buffers, at the same addresses, with
the same numbers, as a CUDA graph would replay them); the CUDA tests capture real graphs. The eager
reference is the probe through transformers' layers with the attention ragkv's dispatcher runs on
a GPU (``_probe_attention``; on the CPU the native kernel is switched off for it).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, _question_attention, _run_layer, _Step, fuse, fuse_steps
from ragkv.gpu import graphs
from ragkv.model import ModelAdapter, load_model
from ragkv.model.attention import PLAIN
from ragkv.types import ChunkKV
from tests.conftest import make_model
from tests.gpu.graph_safety import strict_eager

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])]


def _adapter(family: str, vocab: int, tokenizer, device: str, dtype: torch.dtype) -> ModelAdapter:
    return load_model((make_model(family, vocab), tokenizer), device=device, dtype=dtype)


def _buffer(a: ModelAdapter, n_ctx: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    s = a.spec
    shape = (s.num_layers, s.num_kv_heads, n_ctx + extra, s.head_dim)
    keys, values = (torch.randn(shape, generator=g).to(device=a.device, dtype=a.dtype) for _ in range(2))
    keys[:, :, n_ctx:].zero_()
    values[:, :, n_ctx:].zero_()
    return keys, values


def small_prompt(a: ModelAdapter) -> tuple[ChunkKV, list[ChunkKV], list[list[int]], list[int]]:
    """A prefix of 6 tokens, three chunks of 30 (their caches computed after the prefix) and a
    question of 16: the prefix's cache, the chunks' caches, the chunks' ids, the question's ids."""
    g = torch.Generator().manual_seed(5)
    prefix_ids = torch.randint(0, 200, (6,), generator=g).tolist()
    chunk_ids = [torch.randint(0, 200, (30,), generator=g).tolist() for _ in range(3)]
    question = torch.randint(0, 200, (16,), generator=g).tolist()
    prefix = a.prefill_kv(prefix_ids)
    return prefix, [a.prefill_kv(c, past=[prefix]) for c in chunk_ids], chunk_ids, question


def _probe(a: ModelAdapter, monkeypatch, setting: str, n_ctx: int, question: list[int]):
    """The probe's weights and the buffer after it (its question K/V in the free slots)."""
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", setting)
    monkeypatch.setattr(a, "scattered", lambda pos: PLAIN)  # the GPU's attention on the CPU too
    keys, values = _buffer(a, n_ctx, len(question))
    slots = torch.arange(4, n_ctx, device=a.device)
    with torch.inference_mode():
        weights = _question_attention(a, keys, values, torch.tensor(question), n_ctx, slots)
    return weights, keys, values


_PLAIN_EAGER = graphs._eager


@pytest.fixture(autouse=True)
def _fresh_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "_eager", strict_eager)  # every CPU replay checked against its capture
    graphs._MODELS.clear()
    yield
    graphs._MODELS.clear()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_layers_equal_the_eager_probe_bit_for_bit_when_the_question_fills_its_bucket(
    tiny_tokenizer, monkeypatch, device, family, dtype
):
    a = _adapter(family, len(tiny_tokenizer), tiny_tokenizer, device, dtype)
    question = torch.randint(0, 200, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    replay = "eager" if device == "cpu" else "auto"
    want = _probe(a, monkeypatch, "0", 50, question)
    got = _probe(a, monkeypatch, replay, 50, question)
    assert graphs._MODELS[a.model].buckets.keys() == {16}
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g), (family, dtype, float((w.float() - g.float()).abs().max()))
    again = _probe(a, monkeypatch, replay, 50, question)  # the second use replays what the first made
    assert all(torch.equal(w, g) for w, g in zip(want, again, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_shorter_question_padded_to_its_bucket_ranks_as_the_eager_probe(tiny_tokenizer, monkeypatch, device):
    """11 rows in the 16-row bucket: a product over more rows may round its last bits otherwise; the
    weights stay within rounding, the ranking the same, and a shorter question after a longer one
    (stale rows in the buffers) changes nothing."""
    a = _adapter("qwen2", len(tiny_tokenizer), tiny_tokenizer, device, torch.float32)
    replay = "eager" if device == "cpu" else "auto"
    for n in (11, 16, 11, 3):  # a shorter question after a longer one in the same bucket: stale rows
        question = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        want, wk, wv = _probe(a, monkeypatch, "0", 40, question)
        got, gk, gv = _probe(a, monkeypatch, replay, 40, question)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-5)
        if device == "cpu":  # on a GPU near-ties may order otherwise within rounding
            assert torch.equal(got.sum(0).argsort(descending=True)[:10], want.sum(0).argsort(descending=True)[:10])
    assert set(graphs._MODELS[a.model].buckets) == {8, 16}


@pytest.mark.parametrize("device", DEVICES)
def test_a_fusion_with_the_replayed_probe_equals_the_eager_one(tiny_tokenizer, monkeypatch, device):
    """On CUDA the chunks come from the host, staged by the feed's worker thread while the graphs are
    captured (the capture is thread-local: the worker's copies go on)."""
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, device, torch.bfloat16)
    monkeypatch.setattr(a, "scattered", lambda pos: PLAIN)
    prefix, chunks, chunk_ids, question = small_prompt(a)
    chunks = [type(kv)(kv.keys.cpu(), kv.values.cpu(), kv.positions, kv.model_fingerprint) for kv in chunks]
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "0")  # the probe's graphs alone
    fused = {}
    for setting in ("0", "eager" if device == "cpu" else "auto"):
        monkeypatch.setenv("RAGKV_PROBE_GRAPHS", setting)
        out = fuse(a, FusionInput(prefix, chunks, chunk_ids, question), FusionConfig(ratio=0.3), prefill_suffix=True)
        fused[setting] = out
    plain, replayed = fused.values()
    assert graphs._MODELS[a.model].buckets.keys() == {16}
    assert torch.equal(plain.selected, replayed.selected)
    assert torch.equal(plain.suffix_logits, replayed.suffix_logits)


def test_the_eager_layers_run_where_replays_do_not_apply(tiny_tokenizer, monkeypatch):
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.delenv("RAGKV_PROBE_GRAPHS", raising=False)
    assert graphs.layer_graphs(a, 16, "probe") is None  # a CPU model by default
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "eager")
    assert graphs.layer_graphs(a, 16, "probe") is not None
    assert graphs.layer_graphs(a, graphs.BUCKETS[-1] + 1, "probe") is None  # a question longer than every bucket
    assert graphs.layer_graphs(a, 0, "probe") is None
    gelu = ModelAdapter(make_model("llama", len(tiny_tokenizer), hidden_act="gelu"), tiny_tokenizer)
    assert graphs.layer_graphs(gelu, 16, "probe") is None  # arithmetic ragkv does not know


def test_a_capture_that_fails_leaves_the_model_on_the_eager_layers(tiny_tokenizer, monkeypatch, caplog):
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "eager")
    question = list(range(1, 17))
    want = _probe(a, monkeypatch, "0", 40, question)[0]

    def refused(fns):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._MODELS[a.model] = graphs._ModelGraphs(refused, graphs._replayable(a.model))
    with caplog.at_level("WARNING", logger="ragkv.gpu.graphs"):
        got = _probe(a, monkeypatch, "eager", 40, question)[0]
    assert torch.equal(got, want) and "run eagerly" in caplog.text
    assert graphs._MODELS[a.model].failed and graphs.layer_graphs(a, 8, "probe") is None


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_made_in_inference_mode_serve_a_probe_run_outside_it(tiny_tokenizer, monkeypatch, device):
    """The answer path probes in inference mode, a benchmark may not: the model's buffers serve both."""
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, device, torch.float32)
    replay = "eager" if device == "cpu" else "auto"
    question = list(range(1, 17))
    want = _probe(a, monkeypatch, "0", 40, question)[0]
    assert torch.equal(_probe(a, monkeypatch, replay, 40, question)[0], want)  # made in inference mode
    keys, values = _buffer(a, 40, 16)
    got = _question_attention(a, keys, values, torch.tensor(question), 40, torch.arange(4, 40, device=a.device))
    assert torch.equal(got, want)


def test_probes_on_several_threads_each_get_their_own_answer(tiny_tokenizer, monkeypatch):
    """The buffers are the model's: engines that share a model but not a lock probe one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    questions = [torch.randint(0, 200, (16,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    alone = [_probe(a, monkeypatch, "eager", 40, q)[0] for q in questions]

    def one(i: int) -> torch.Tensor:
        keys, values = _buffer(a, 40, 16)
        with torch.inference_mode():
            return _question_attention(a, keys, values, torch.tensor(questions[i]), 40, torch.arange(4, 40))

    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert all(torch.equal(got, want) for got, want in zip(pool.map(one, range(4)), alone, strict=True))


# --- the recompute's layers -------------------------------------------------------------------------


def _recompute_case(a: ModelAdapter, rows: int, n_ctx: int, seed: int):
    """Rows at sorted distinct slots of an ``n_ctx``-slot buffer, their hidden states, and the buffer."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(n_ctx, generator=g)[:rows].sort().values
    hidden = torch.randn(1, rows, a.model.config.hidden_size, generator=g).to(device=a.device, dtype=a.dtype)
    keys, values = _buffer(a, n_ctx, 0)
    return pos, hidden, keys, values


def _layers(a: ModelAdapter, monkeypatch, setting: str, pos, hidden, keys, values):
    """Every decoder layer through fusion's layer call (``setting``: RAGKV_RECOMPUTE_GRAPHS): the last
    hidden states and the buffer they wrote into."""
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", setting)
    keys, values = keys.clone(), values.clone()
    cache = a.scatter_cache(keys, values)
    with torch.inference_mode():
        step = _Step.at(a, pos, keys.shape[2], hidden)
        for layer in range(a.spec.num_layers):
            hidden = _run_layer(a, layer, hidden, step, cache)
    return hidden, keys, values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_recompute_layers_equal_the_models_layers_bit_for_bit_when_the_rows_fill_their_bucket(
    tiny_tokenizer, monkeypatch, device, family, dtype
):
    """The attention goes through the model's attention function as its layer calls it (on the CPU
    ragkv's kernel where it runs, from the rows' positions)."""
    a = _adapter(family, len(tiny_tokenizer), tiny_tokenizer, device, dtype)
    replay = "eager" if device == "cpu" else "auto"
    case = _recompute_case(a, 32, 80, seed=7)
    want = _layers(a, monkeypatch, "0", *case)
    got = _layers(a, monkeypatch, replay, *case)
    assert graphs._MODELS[a.model].buckets.keys() == {32}
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g), (family, dtype, float((w.float() - g.float()).abs().max()))
    assert all(torch.equal(w, g) for w, g in zip(want, _layers(a, monkeypatch, replay, *case), strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_rows_padded_to_their_bucket_stay_within_rounding(tiny_tokenizer, monkeypatch, device):
    """Rows that do not fill a bucket, fewer after more (stale rows in the shared buffers), and a
    bucket above the powers of two (300 rows in 384)."""
    a = _adapter("qwen2", len(tiny_tokenizer), tiny_tokenizer, device, torch.float32)
    replay = "eager" if device == "cpu" else "auto"
    for rows, n_ctx in ((300, 400), (11, 40), (16, 40), (5, 40)):
        case = _recompute_case(a, rows, n_ctx, seed=rows)
        want = _layers(a, monkeypatch, "0", *case)
        got = _layers(a, monkeypatch, replay, *case)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert set(graphs._MODELS[a.model].buckets) == {8, 16, 384}


@pytest.mark.parametrize("device", DEVICES)
def test_a_fusion_with_replayed_layers_selects_as_the_eager_one(tiny_tokenizer, monkeypatch, device):
    """The probe and the recompute replayed; the recompute in pieces, another request's fusion run
    between them (the buffers are the model's): the same tokens selected, the fused cache and the
    logits within rounding of the eager fusion's, and equal to the same fusion run alone."""
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, device, torch.float32)
    g = torch.Generator().manual_seed(9)
    prefix = a.prefill_kv(torch.randint(0, 200, (6,), generator=g).tolist())

    def request(seed: int) -> FusionInput:
        g = torch.Generator().manual_seed(seed)
        chunk_ids = [torch.randint(0, 200, (40,), generator=g).tolist() for _ in range(3)]
        chunks = [a.prefill_kv(c, past=[prefix]) for c in chunk_ids]
        return FusionInput(prefix, chunks, chunk_ids, torch.randint(0, 200, (13,), generator=g).tolist())

    config = FusionConfig(ratio=0.3)
    first, second = request(1), request(2)
    replay = "eager" if device == "cpu" else "auto"
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "0")
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "0")
    plain = [fuse(a, r, config, prefill_suffix=True) for r in (first, second)]
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", replay)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", replay)
    alone = [fuse(a, r, config, prefill_suffix=True) for r in (first, second)]
    assert len(graphs._MODELS[a.model].buckets) >= 2  # the probe's bucket and the recompute's
    for want, got in zip(plain, alone, strict=True):
        assert torch.equal(want.selected, got.selected)
        torch.testing.assert_close(got.suffix_logits, want.suffix_logits, rtol=1e-4, atol=1e-4)
        for layer in range(a.spec.num_layers):
            for w, o in zip(want.cache.layers[layer].keys, got.cache.layers[layer].keys, strict=True):
                torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)
    # both in pieces of one layer each, interleaved
    steps = [fuse_steps(a, r, config, prefill_suffix=True, step_tokens=1) for r in (first, second)]
    done: dict[int, object] = {}
    while len(done) < 2:
        for i, s in enumerate(steps):
            if i not in done:
                try:
                    next(s)
                except StopIteration as stop:
                    done[i] = stop.value
    for i, want in enumerate(alone):
        got = done[i]
        assert torch.equal(want.selected, got.selected)
        assert torch.equal(want.suffix_logits, got.suffix_logits)


def test_capture_all_makes_every_bucket_where_a_pass_replays(tiny_tokenizer, monkeypatch):
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.delenv("RAGKV_PROBE_GRAPHS", raising=False)
    monkeypatch.delenv("RAGKV_RECOMPUTE_GRAPHS", raising=False)
    assert graphs.capture_all(a) == 0 and a.model not in graphs._MODELS  # a CPU model by default
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager")
    assert graphs.capture_all(a, (8, 640)) == 2
    assert set(graphs._MODELS[a.model].buckets) == {8, 640}
    assert graphs.layer_graphs(a, 600, "recompute") is graphs._MODELS[a.model].buckets[640]  # made, not remade


def test_out_of_memory_while_capturing_runs_eagerly_for_a_while_then_captures(tiny_tokenizer, monkeypatch):
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager")
    calls = []

    def tight(fns):
        calls.append(len(fns))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return graphs._eager(fns)

    graphs._MODELS[a.model] = model = graphs._ModelGraphs(tight, graphs._replayable(a.model))
    assert graphs.layer_graphs(a, 16, "recompute") is None and not model.failed
    assert graphs.layer_graphs(a, 16, "recompute") is None and len(calls) == 1  # no capture while backing off
    model.retry_at = 0.0  # the time has passed
    assert graphs.layer_graphs(a, 16, "recompute") is not None and len(calls) == 2


class _FakeGraph:
    """A CUDA graph whose capture fails where asked (fault injection: no GPU here)."""

    fail: str = ""
    log: list[str] = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.log.append("begin")

    def capture_end(self):
        self.log.append("end")
        if self.fail == "end":
            raise RuntimeError("operation failed due to a previous error during capture")

    def replay(self):
        pass


@pytest.mark.parametrize("where", ["fn", "end"])
def test_a_capture_that_fails_stops_the_allocators_routing_and_leaves_capture_mode(monkeypatch, where):
    """Wherever the capture fails (in the captured function or at its end), the stream leaves capture
    mode and the allocator stops routing to the pool before the error goes on."""
    ended = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: mock.MagicMock())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: mock.MagicMock())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: ended.append(pool), raising=False)
    monkeypatch.setattr(_FakeGraph, "fail", where)
    monkeypatch.setattr(_FakeGraph, "log", [])
    capture = graphs._cuda_graphs(torch.device("cuda", 0), "pool")
    ran = []

    def fn():
        ran.append(1)
        if where == "fn" and len(ran) > 1:  # the warm-up passes; the capture fails
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError):
        capture([fn])
    assert ended == ["pool"]
    assert _FakeGraph.log[-1] == "end"  # capture mode left
    assert _FakeGraph.log.count("end") == (1 if where == "fn" else 2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_replayed_layer_launches_under_half_the_kernels_of_the_models_layer(family, monkeypatch):
    """Counted, not timed (experiments/graph_launches.py): the kernels a layer issues outside its
    graphs, each replay counted as one launch. The eager counts are the GPU profile's (44 a probe layer)."""
    import importlib.util
    from pathlib import Path

    monkeypatch.setattr(graphs, "_eager", _PLAIN_EAGER)  # the count replaces the replays' own runs
    path = Path(__file__).resolve().parents[2] / "experiments" / "graph_launches.py"
    spec = importlib.util.spec_from_file_location("graph_launches", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module.measure(family, rows=32, context=128)
    assert got["probe_eager"] >= 40 and got["recompute_eager"] >= 35
    assert got["probe_replayed"] <= 20 and got["recompute_replayed"] <= 14


def test_the_graphs_do_not_keep_their_model_alive(tiny_tokenizer, monkeypatch):
    import gc
    import weakref

    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager")
    assert graphs.capture_all(a, (8, 16)) == 2
    model = weakref.ref(a.model)
    del a
    gc.collect()
    assert model() is None and len(graphs._MODELS) == 0


def test_keep_eager_holds_whatever_the_settings(tiny_tokenizer, monkeypatch):
    a = _adapter("llama", len(tiny_tokenizer), tiny_tokenizer, "cpu", torch.float32)
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "eager")
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager")
    graphs.keep_eager(a)
    assert graphs.layer_graphs(a, 16, "probe") is None and graphs.capture_all(a) == 0
