"""LayerFeed: the fused buffer filled layer by layer equals chunk-by-chunk placement, staged or not.

The CPU runs everything but the copy stream: ``stage=True`` sends every chunk through the staging
worker (plain host slabs instead of pinned ones), which checks the pipeline's ordering; the CUDA
tests at the end run the real one (pinned slabs, a copy stream, events) against the eager path.
``tests/gpu/test_stream_safety.py`` runs the worker under CUDA's stream semantics faked on the CPU,
and a whole fusion through a staged feed there, against a fusion in place.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.gpu import feed as feed_module
from ragkv.gpu.feed import DeviceSink, LayerFeed, PinnedPool
from ragkv.model import ModelAdapter, load_model
from ragkv.types import ChunkKV
from tests.conftest import make_model
from tests.core.test_fusion import _prompt
from tests.model.families import FAMILIES


def _slow_place(a: ModelAdapter, inp: FusionInput, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious placement: every chunk re-rotated on its own (ModelAdapter.rerotate), concatenated."""
    keys, values = [inp.prefix.keys], [inp.prefix.values]
    offset = inp.prefix.num_tokens
    for kv in inp.chunks:
        keys.append(a.rerotate(kv, offset).keys)
        values.append(kv.values)
        offset += kv.num_tokens
    pad = torch.zeros(a.spec.num_layers, a.spec.num_kv_heads, extra, a.spec.head_dim, dtype=a.dtype)
    return torch.cat([*keys, pad], 2).to(a.dtype), torch.cat([*values, pad], 2).to(a.dtype)


@pytest.mark.parametrize("stage", [False, True], ids=["in-place", "staged"])
def test_the_feed_equals_placing_chunk_by_chunk(tiny_adapter, stage):
    a = tiny_adapter
    _, _, _, inp = _prompt(a)
    feed = LayerFeed(a, inp.prefix, inp.chunks, extra=5, stage=stage)
    feed.all_ready()
    want_k, want_v = _slow_place(a, inp, 5)
    assert torch.equal(feed.keys, want_k) and torch.equal(feed.values, want_v)


# each rotation layout the feed turns keys through: half-split; interleaved and partial (GLM-4); a
# rotation that rounds to its input's dtype (OLMo 2); one that converts to fp32 itself (ERNIE 4.5);
# partial rotary (StableLM); layers without RoPE (SmolLM3)
_ROTATIONS = ["llama", "glm4", "olmo2", "ernie4_5", "stablelm", "smollm3"]


@pytest.mark.parametrize("as_stored", [True, False], ids=["as-stored", "fp32-copy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", _ROTATIONS)
def test_half_precision_keys_turned_as_they_are_equal_rerotating_them_in_fp32(
    tiny_tokenizer, monkeypatch, family, dtype, as_stored
):
    """On CUDA the feed turns a bf16/fp16 model's keys without converting them to fp32 first (the
    CPU converts: faster there); either way the result is bit for bit ModelAdapter.rerotate's,
    which turns ``keys.float()``."""
    monkeypatch.setattr(feed_module, "_turns_as_stored", lambda device: as_stored)
    _, model_type, overrides, _ = next(f for f in FAMILIES if f[0] == family)
    a = load_model((make_model(model_type, len(tiny_tokenizer), **dict(overrides)), tiny_tokenizer), dtype=dtype)
    _, _, _, inp = _prompt(a, sizes=(20, 17, 23, 9))
    feed = LayerFeed(a, inp.prefix, inp.chunks, extra=3)
    feed.all_ready()
    want_k, want_v = _slow_place(a, inp, 3)
    assert feed.keys.dtype == dtype
    assert torch.equal(feed.keys, want_k) and torch.equal(feed.values, want_v)


def test_chunks_stored_in_another_dtype_are_staged_as_stored_and_converted_on_the_way(tiny_adapter):
    # raw chunks of a bf16 model on a GPU stay fp16 views of their bytes: the slab holds fp16 (a
    # memcpy) and the conversion runs after the crossing; the result is the in-place conversion's
    a = tiny_adapter
    _, _, _, inp = _prompt(a)
    half = [type(kv)(kv.keys.half(), kv.values.half(), kv.positions, kv.model_fingerprint) for kv in inp.chunks]
    eager = LayerFeed(a, inp.prefix, half, extra=3, stage=False)
    eager.all_ready()
    staged = LayerFeed(a, inp.prefix, half, extra=3, stage=True)
    staged.all_ready()
    assert staged.keys.dtype == a.dtype != torch.float16
    assert torch.equal(staged.keys, eager.keys) and torch.equal(staged.values, eager.values)
    mixed = [half[0], *inp.chunks[1:]]  # dtypes differ: staged in the model's dtype, as before
    eager = LayerFeed(a, inp.prefix, mixed, stage=False)
    eager.all_ready()
    staged = LayerFeed(a, inp.prefix, mixed, stage=True)
    staged.all_ready()
    assert torch.equal(staged.keys, eager.keys) and torch.equal(staged.values, eager.values)


@pytest.mark.parametrize("half", [False, True], ids=["model-dtype", "fp16"])
def test_pinned_chunks_cross_from_where_they_are_and_equal_the_slab_path(tiny_adapter, monkeypatch, half):
    # a CPU has no page-locked memory: the test says every chunk is pinned, and the direct path
    # (no slab) must fill the buffer as the slab path does
    import ragkv.gpu.feed as feed_mod

    a = tiny_adapter
    _, _, _, inp = _prompt(a)
    chunks = [ChunkKV(kv.keys.half(), kv.values.half(), kv.positions, kv.model_fingerprint) for kv in inp.chunks]
    chunks = chunks if half else list(inp.chunks)
    want = LayerFeed(a, inp.prefix, chunks, extra=2, stage=True)
    want.all_ready()

    class NoSlabs(PinnedPool):
        def take(self, nbytes: int) -> torch.Tensor:
            raise AssertionError("pinned chunks need no slab")

    monkeypatch.setattr(feed_mod, "_is_pinned", lambda t: True)
    got = LayerFeed(a, inp.prefix, chunks, extra=2, stage=True, pool=NoSlabs())
    got.all_ready()
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_layers_become_ready_one_at_a_time_in_any_order(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    want_k, _ = _slow_place(a, inp, 0)
    feed = LayerFeed(a, inp.prefix, inp.chunks, stage=True)
    for layer in reversed(range(a.spec.num_layers)):  # a layer is complete on its own
        feed.ready(layer)
        assert torch.equal(feed.keys[layer], want_k[layer])
    feed.ready(0)  # twice: no second rotation
    assert torch.equal(feed.keys, want_k)


def test_a_chunk_computed_where_it_goes_is_kept_bit_for_bit(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    feed = LayerFeed(a, inp.prefix, inp.chunks)
    feed.all_ready()
    first = inp.chunks[0]  # computed right after the prefix: its stored positions are its slots
    n = inp.prefix.num_tokens
    assert torch.equal(feed.keys[:, :, n : n + first.num_tokens], first.keys)


def test_sinks_receive_the_chunk_as_stored_and_are_told_once(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    told: list[int] = []
    sinks = [
        DeviceSink(torch.empty_like(kv.keys), torch.empty_like(kv.values), lambda i=i: told.append(i))
        for i, kv in enumerate(inp.chunks)
    ]
    feed = LayerFeed(a, inp.prefix, inp.chunks, sinks=sinks, stage=True)
    for layer in range(a.spec.num_layers - 1):
        feed.ready(layer)
    assert told == []  # filled only once every layer is in
    feed.all_ready()
    feed.all_ready()
    assert told == [0, 1, 2]
    for sink, kv in zip(sinks, inp.chunks, strict=True):  # before re-rotation: what decoding gave
        assert torch.equal(sink.keys, kv.keys) and torch.equal(sink.values, kv.values)


def test_a_failing_stage_fails_the_fusion_not_the_process(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)

    class Broken(PinnedPool):
        def take(self, nbytes: int) -> torch.Tensor:
            raise MemoryError("no pinned memory")

    feed = LayerFeed(a, inp.prefix, inp.chunks, stage=True, pool=Broken())
    with pytest.raises(RuntimeError, match="staging chunk caches"):
        feed.ready(0)


def test_the_pool_reuses_slabs_and_keeps_a_few():
    pool = PinnedPool(keep=2)
    a = pool.take(10)
    pool.give(a)
    assert pool.take(5) is a  # reused, not allocated again
    slabs = [pool.take(2 << 20) for _ in range(3)]
    for s in slabs:
        pool.give(s)
    assert pool.idle_bytes == 2 * (2 << 20)


def test_the_pool_hands_a_slab_to_one_user_at_a_time():
    pool = PinnedPool()
    taken: list[int] = []
    lock = threading.Lock()

    def user() -> None:
        for _ in range(50):
            s = pool.take(1 << 20)
            with lock:
                assert s.data_ptr() not in taken
                taken.append(s.data_ptr())
            with lock:
                taken.remove(s.data_ptr())
            pool.give(s)

    threads = [threading.Thread(target=user) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_staged_host_chunks_equal_chunks_on_the_device(tiny_tokenizer, dtype):
    from ragkv.model import load_model
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=dtype)
    _, _, _, inp = _prompt(a, sizes=(200, 170, 230, 64))
    on_host = [type(kv)(kv.keys.cpu(), kv.values.cpu(), kv.positions, kv.model_fingerprint) for kv in inp.chunks]
    eager = LayerFeed(a, inp.prefix, inp.chunks, extra=5)
    eager.all_ready()
    staged = LayerFeed(a, inp.prefix, on_host, extra=5)
    for layer in range(a.spec.num_layers):
        staged.ready(layer)
    torch.cuda.synchronize()
    assert torch.equal(staged.keys, eager.keys) and torch.equal(staged.values, eager.values)
    want = fuse(a, inp, FusionConfig(), prefill_suffix=True)
    host_inp = FusionInput(inp.prefix, on_host, inp.chunk_ids, inp.suffix_ids)
    got = fuse(a, host_inp, FusionConfig(), prefill_suffix=True)
    assert got.suffix_logits is not None and want.suffix_logits is not None
    assert torch.equal(got.suffix_logits, want.suffix_logits)

    # fp16 chunks of a bf16 model (raw chunks as the loader leaves them): converted after crossing
    def half(kv: ChunkKV, device: str) -> ChunkKV:
        return ChunkKV(kv.keys.half().to(device), kv.values.half().to(device), kv.positions, kv.model_fingerprint)

    on_device = LayerFeed(a, inp.prefix, [half(kv, "cuda") for kv in inp.chunks])
    on_device.all_ready()
    staged = LayerFeed(a, inp.prefix, [half(kv, "cpu") for kv in inp.chunks])
    staged.all_ready()
    torch.cuda.synchronize()
    assert torch.equal(staged.keys, on_device.keys) and torch.equal(staged.values, on_device.values)
    pinned = [ChunkKV(kv.keys.pin_memory(), kv.values.pin_memory(), kv.positions, kv.model_fingerprint) for kv in
              (half(kv, "cpu") for kv in inp.chunks)]  # fmt: skip
    direct = LayerFeed(a, inp.prefix, pinned)
    direct.all_ready()
    torch.cuda.synchronize()
    assert torch.equal(direct.keys, on_device.keys) and torch.equal(direct.values, on_device.values)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pinned", [False, True], ids=["slab", "pinned"])
def test_on_cuda_staging_waits_for_compute_work_queued_on_the_memory_its_buffer_reuses(
    tiny_tokenizer, monkeypatch, pinned
):
    # A previous request's kernels may still be queued on the compute stream against memory the
    # caching allocator hands the next feed's buffer. Staging must not write it before they ran:
    # here a slow fill queued on freed tensors of the buffer's size would overwrite the staged
    # layers if the copy stream did not wait (tests/gpu/stream_safety.py checks the rule on the CPU).
    import ragkv.gpu.feed as feed_mod
    from ragkv.model import load_model
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    _, _, _, inp = _prompt(a, sizes=(200, 170, 230, 64))

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.cpu().pin_memory() if pinned else t.cpu()

    on_host = [ChunkKV(host(kv.keys), host(kv.values), kv.positions, kv.model_fingerprint) for kv in inp.chunks]
    want = LayerFeed(a, inp.prefix, inp.chunks, extra=5)
    want.all_ready()
    torch.cuda.synchronize()

    def corrupted_runs() -> int:
        bad = 0
        for _ in range(3):
            junk = [torch.empty_like(want.keys), torch.empty_like(want.values)]
            torch.cuda._sleep(200_000_000)  # the compute stream busy for about 0.1 s
            for x in junk:
                x.fill_(float("nan"))  # queued after the sleep, on memory freed just below
            del junk, x
            staged = LayerFeed(a, inp.prefix, on_host, extra=5)
            staged.all_ready()
            torch.cuda.synchronize()
            bad += not (torch.equal(staged.keys, want.keys) and torch.equal(staged.values, want.values))
        return bad

    # the control: the same runs with the copy stream's wait taken out
    with monkeypatch.context() as m:
        real = feed_mod._Stager.__init__

        def no_wait(self, *args, **kwargs):
            real(self, *args, **kwargs)
            self.after = None

        m.setattr(feed_mod._Stager, "__init__", no_wait)
        reproduced = corrupted_runs()
    assert corrupted_runs() == 0
    if not reproduced:
        pytest.skip("the fixed path ran clean, but without the wait it did too on this device: the test proved nothing")


def test_a_staged_feed_made_in_inference_mode_fills_its_buffer(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    with torch.inference_mode():
        feed = LayerFeed(a, inp.prefix, inp.chunks, stage=True)
        feed.all_ready()
    want_k, _ = _slow_place(a, inp, 0)
    assert torch.equal(feed.keys, want_k)


def test_a_finished_staged_feed_is_freed_without_the_garbage_collector(llama_adapter):
    import gc
    import weakref

    a = llama_adapter
    _, _, _, inp = _prompt(a)
    gc.disable()
    try:
        feed = LayerFeed(a, inp.prefix, inp.chunks, stage=True)
        feed.all_ready()
        feed._worker.thread.join()  # type: ignore[union-attr]
        gone = weakref.ref(feed.keys)
        del feed
        assert gone() is None  # no reference cycle holds the buffer
    finally:
        gc.enable()


def test_a_pass_that_fails_stops_its_staging_and_lets_the_buffer_go(llama_adapter, monkeypatch):
    """A fused pass that raises (out of memory, say) stops its feed's worker after the layer it is on:
    the thread ends and no longer holds the buffer, so a retry can have the memory. A stopped feed
    refuses layers that never landed; the worker's own out-of-memory error keeps its type."""
    import weakref

    import ragkv.fusion

    a = llama_adapter
    _, _, _, inp = _prompt(a)
    feeds: list[LayerFeed] = []
    real = ragkv.fusion.LayerFeed

    def staged(*args, **kw):
        feeds.append(real(*args, **kw, stage=True))
        return feeds[-1]

    monkeypatch.setattr(ragkv.fusion, "LayerFeed", staged)
    failing = lambda *args, **kw: (_ for _ in ()).throw(torch.OutOfMemoryError("injected"))  # noqa: E731
    monkeypatch.setattr(ragkv.fusion, "_run_layer", failing)  # a recompute layer, eager or replayed
    with pytest.raises(torch.OutOfMemoryError, match="injected"):  # no probe: the first layer fails
        fuse(a, inp, FusionConfig(method="blend"), prefill_suffix=True)
    (feed,) = feeds
    assert not all(feed._done)  # the pass ended part-way
    worker = feed._worker
    assert worker is not None and worker.stopped and not worker.thread.is_alive()
    buffer = weakref.ref(feed.keys)
    feeds.clear()
    del feed
    assert buffer() is None  # nothing else held the fused buffer

    plain = LayerFeed(a, inp.prefix, inp.chunks, stage=True)
    plain.ready(0)
    plain.cancel()
    last = a.spec.num_layers - 1
    if not plain._done[last]:
        with pytest.raises(RuntimeError, match="staging was stopped"):
            plain.ready(last)

    class NoRoom(PinnedPool):
        def take(self, nbytes: int) -> torch.Tensor:
            raise torch.OutOfMemoryError("no room for a slab")

    with pytest.raises(torch.OutOfMemoryError, match="no room for a slab"):
        LayerFeed(a, inp.prefix, inp.chunks, stage=True, pool=NoRoom()).ready(0)


@pytest.mark.parametrize("threads", [2, 3])
def test_slab_copies_split_over_threads_fill_the_buffer_as_one_worker_does(tiny_adapter, monkeypatch, threads):
    """``stage_threads``: each copy thread takes every n-th host chunk of a layer (disjoint slab columns)."""
    a = tiny_adapter
    _, _, _, inp = _prompt(a)
    half = [type(kv)(kv.keys.half(), kv.values.half(), kv.positions, kv.model_fingerprint) for kv in inp.chunks]
    for chunks in (inp.chunks, half):
        one = LayerFeed(a, inp.prefix, chunks, extra=2, stage=True)
        one.all_ready()
        split = LayerFeed(a, inp.prefix, chunks, extra=2, stage=True, stage_threads=threads)
        split.all_ready()
        assert split._worker is not None and split._worker.copiers is not None
        assert torch.equal(split.keys, one.keys) and torch.equal(split.values, one.values)
    monkeypatch.setenv("RAGKV_STAGE_THREADS", str(threads))
    from_env = LayerFeed(a, inp.prefix, inp.chunks, stage=True)
    from_env.all_ready()
    assert from_env._worker is not None and from_env._worker.copiers is not None
    for bad in ("many", "0"):
        monkeypatch.setenv("RAGKV_STAGE_THREADS", bad)
        with pytest.raises(ValueError, match="RAGKV_STAGE_THREADS"):
            LayerFeed(a, inp.prefix, inp.chunks, stage=True)


def test_a_failing_slab_copy_fails_the_layer_after_every_copy_has_ended(tiny_adapter, monkeypatch):
    import ragkv.gpu.feed as feed_mod

    a = tiny_adapter
    _, _, _, inp = _prompt(a)
    real = feed_mod._Stager._copy_part

    def failing(self, layer, view, part):
        if layer == 1 and part.start == 0:
            raise RuntimeError("copy failed (injected)")
        return real(self, layer, view, part)

    monkeypatch.setattr(feed_mod._Stager, "_copy_part", failing)
    pool = feed_mod.PinnedPool()
    feed = LayerFeed(a, inp.prefix, inp.chunks, stage=True, stage_threads=2, pool=pool)
    with pytest.raises(RuntimeError, match="injected"):  # at layer 1, or at 0 if the worker failed first
        feed.all_ready()
    worker = feed._worker
    assert worker is not None
    worker.thread.join()
    assert pool.idle_bytes > 0  # the slabs went back once every copy had ended
