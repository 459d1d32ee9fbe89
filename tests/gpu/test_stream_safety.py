"""The staging pipeline under CUDA's stream semantics, faked on the CPU (``tests/gpu/stream_safety.py``).

First the fake itself: hand-made pipelines that break each rule are caught, and one that keeps them
computes right. Then ``ragkv.gpu.feed`` under it: every layer lands, re-rotated, equal to placing
chunk by chunk, whatever the chunks' dtype, page-locked or not, in one run or several, with copy
threads or not; and a fusion through it equals a fusion in place, with every ATen call of the
fusion checked against the copies still pending.
"""

from __future__ import annotations

import pytest
import torch

import ragkv.gpu.feed as feed_mod
from ragkv.fusion import FusionConfig, fuse
from ragkv.gpu.feed import DeviceSink, LayerFeed
from ragkv.types import ChunkKV
from tests.core.test_fusion import _prompt
from tests.gpu.stream_safety import LazyStreams, StreamBreach, lazy_streams
from tests.gpu.test_feed import _slow_place


def _side(s: LazyStreams):
    """A side stream that has waited for the compute stream (the right start)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


# -- the fake: each rule, broken by hand ------------------------------------------------------------


def test_a_pipeline_that_keeps_the_rules_computes_right(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        dst = torch.zeros(4, 8)
        slab = s.host(torch.arange(32.0).view(4, 8), pinned=True)
        side = _side(s)
        dst.record_stream(side)
        with torch.cuda.stream(side):
            dst[:2].copy_(slab[:2], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        with s.peek():
            assert torch.equal(dst, torch.zeros(4, 8))  # still pending: nothing ran
        torch.cuda.current_stream().wait_event(done)
        assert torch.equal(dst[:2], slab[:2]) and s.breaches == []


def test_the_compute_stream_touching_a_pending_copy_is_caught(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        dst = torch.zeros(4, 8)
        slab = s.host(torch.ones(4, 8), pinned=True)
        side = _side(s)
        dst.record_stream(side)
        with torch.cuda.stream(side):
            dst[:2].copy_(slab[:2], non_blocking=True)
        dst[2:].sum()  # rows the copy does not write: allowed
        with pytest.raises(StreamBreach, match="pending copy writes"):
            dst[:2].sum()  # no wait for the side stream
        with pytest.raises(StreamBreach, match="pending copy reads"):
            slab.mul_(2)  # the slab is read by the copy still queued
        side.synchronize()
        dst.sum()  # after the copy ran: allowed


def test_a_slab_rewritten_or_given_back_under_a_pending_copy_is_caught(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        pool = s.pool()
        slab = pool.take(1 << 20)
        dst = torch.zeros(16)
        side = _side(s)
        dst.record_stream(side)
        chunk = s.host(torch.ones(16), pinned=False)
        with torch.cuda.stream(side):
            view = slab[:64].view(torch.float32)
            view.copy_(chunk)  # host to host: runs now
            dst.copy_(view, non_blocking=True)
            with pytest.raises(StreamBreach, match="still reads"):
                view.copy_(chunk)  # the next layer into the same slab, its copy not waited for
        with pytest.raises(StreamBreach, match="back to the pool"):
            pool.give(slab)
        assert len(s.breaches) == 2


def test_a_side_write_into_compute_memory_needs_a_wait_and_record_stream(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        slab = s.host(torch.ones(8), pinned=True)
        side = torch.cuda.Stream()
        early = torch.cuda.Event()
        early.record(torch.cuda.current_stream())
        side.wait_event(early)  # waited, but before the buffer was allocated
        dst = torch.zeros(8)
        with torch.cuda.stream(side), pytest.raises(StreamBreach, match="without waiting"):
            dst.copy_(slab, non_blocking=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), pytest.raises(StreamBreach, match="record_stream"):
            dst.copy_(slab, non_blocking=True)
        dst.record_stream(side)
        with torch.cuda.stream(side):
            dst.copy_(slab, non_blocking=True)
            mine = torch.empty(8)  # the side stream's own allocation needs neither
            mine.copy_(slab, non_blocking=True)
        side.synchronize()
        assert torch.equal(dst, slab) and len(s.breaches) == 2


def test_a_side_copy_after_compute_work_on_its_memory_needs_a_wait_since(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        slab = s.host(torch.ones(8), pinned=True)
        dst, src = torch.zeros(8), torch.zeros(8)
        side = _side(s)
        dst.record_stream(side)
        src.record_stream(side)
        dst[4:].add_(1)  # compute work after the side stream's wait
        src.add_(1)
        with torch.cuda.stream(side):
            dst[:4].copy_(slab[:4], non_blocking=True)  # other elements: allowed
            with pytest.raises(StreamBreach, match="compute stream wrote after"):
                dst[4:].copy_(slab[4:], non_blocking=True)  # write after write
            with pytest.raises(StreamBreach, match="reads device memory the compute stream wrote after"):
                torch.empty(8).copy_(src, non_blocking=True)  # read after write
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst[4:].copy_(slab[4:], non_blocking=True)
            torch.empty(8).copy_(src, non_blocking=True)
        side.synchronize()
        assert len(s.breaches) == 2


def test_memory_from_before_the_fake_or_read_without_record_stream_is_caught(monkeypatch):
    before = torch.zeros(8)
    with lazy_streams(monkeypatch) as s:
        slab = s.host(torch.ones(8), pinned=True)
        side = torch.cuda.Stream()
        before.record_stream(side)
        with torch.cuda.stream(side), pytest.raises(StreamBreach, match="without waiting"):
            before.copy_(slab, non_blocking=True)
        src = torch.ones(8)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), pytest.raises(StreamBreach, match="reads device memory it did not allocate"):
            torch.empty(8).copy_(src, non_blocking=True)
        with pytest.raises(StreamBreach, match="set_stream"):
            torch.cuda.set_stream(side)
        assert len(s.breaches) == 3


def test_copies_from_pageable_or_strided_host_memory_and_blocking_copies_are_caught(monkeypatch):
    with lazy_streams(monkeypatch) as s:
        pageable = s.host(torch.ones(4, 8), pinned=False)
        pinned = s.host(torch.ones(4, 8), pinned=True)
        side = _side(s)
        with torch.cuda.stream(side):
            mine = torch.empty(4, 4)
            with pytest.raises(StreamBreach, match="pageable"):
                mine.copy_(pageable[:, :4], non_blocking=True)
            with pytest.raises(StreamBreach, match="non-contiguous"):
                mine.copy_(pinned[:, :4], non_blocking=True)
            with pytest.raises(StreamBreach, match="non_blocking"):
                mine.copy_(pinned[:2].view(4, 4))
            with pytest.raises(StreamBreach, match="models views, allocations and copies"):
                mine.add_(1)


# -- the feed under the fake ----------------------------------------------------------------------


def _chunks(inp, s: LazyStreams, *, half: bool, pinned: bool) -> list[ChunkKV]:
    out = []
    for kv in inp.chunks:
        k, v = (kv.keys.half(), kv.values.half()) if half else (kv.keys.clone(), kv.values.clone())
        out.append(ChunkKV(s.host(k, pinned=pinned), s.host(v, pinned=pinned), kv.positions, kv.model_fingerprint))
    return out


def _staged_against_in_place(a, inp, make_chunks, monkeypatch, extra: int, threads: int = 1) -> None:
    """Chunks (``make_chunks(fake)``, host memory said under the fake) staged under CUDA's stream
    semantics fill the buffer as they do placed in place, with no rule broken."""
    with lazy_streams(monkeypatch) as s:
        chunks = make_chunks(s)
        feed = LayerFeed(a, inp.prefix, chunks, extra=extra, stage=True, stage_threads=threads)
        feed.all_ready()
        got_k, got_v = feed.keys.clone(), feed.values.clone()
    want = LayerFeed(a, inp.prefix, chunks, extra=extra, stage=False)  # in place, no streams
    want.all_ready()
    assert s.breaches == []
    assert torch.equal(got_k, want.keys) and torch.equal(got_v, want.values)


@pytest.mark.parametrize("half", [False, True], ids=["model-dtype", "fp16"])
@pytest.mark.parametrize("pinned", [False, True], ids=["slab", "pinned"])
@pytest.mark.parametrize("threads", [1, 2])
def test_staging_keeps_cuda_stream_semantics_and_fills_the_buffer(tiny_adapter, monkeypatch, half, pinned, threads):
    _, _, _, inp = _prompt(tiny_adapter)
    make = lambda s: _chunks(inp, s, half=half, pinned=pinned)  # noqa: E731
    _staged_against_in_place(tiny_adapter, inp, make, monkeypatch, extra=3, threads=threads)


@pytest.mark.parametrize("pinned", [False, True], ids=["slab", "pinned"])
def test_host_chunks_of_mixed_dtypes_land_each_in_its_own_dtype(llama_adapter, monkeypatch, pinned):
    # fp16 chunks (raw, as the loader leaves them) beside chunks in the model's dtype (decoded on
    # the device, then kept by the host tier): pinned ones cross in their own dtype, converted after
    _, _, _, inp = _prompt(llama_adapter, sizes=(20, 17, 23, 11))

    def make(s: LazyStreams) -> list[ChunkKV]:
        half, same = _chunks(inp, s, half=True, pinned=pinned), _chunks(inp, s, half=False, pinned=pinned)
        return [half[0], same[1], half[2], same[3]]

    _staged_against_in_place(llama_adapter, inp, make, monkeypatch, extra=2)


@pytest.mark.parametrize("half", [False, True], ids=["model-dtype", "fp16"])
def test_host_chunks_between_device_chunks_cross_in_runs(llama_adapter, monkeypatch, half):
    # chunks 0 and 2 staged, chunk 1 already on the device: two runs of the slab's columns, which
    # are not contiguous in it; every layer still crosses from page-locked, contiguous memory
    a = llama_adapter
    _, _, _, inp = _prompt(a, sizes=(20, 17, 23, 11))
    with lazy_streams(monkeypatch) as s:
        chunks = _chunks(inp, s, half=half, pinned=False)
        chunks[1] = inp.chunks[1]
        feed = LayerFeed(a, inp.prefix, chunks, extra=2, stage=[True, False, True, True])
        for layer in reversed(range(a.spec.num_layers)):  # any order
            feed.ready(layer)
        got_k, got_v = feed.keys.clone(), feed.values.clone()
    want_k, want_v = _slow_place(a, inp, 2)
    assert s.breaches == []
    if half:
        want = LayerFeed(a, inp.prefix, chunks, extra=2, stage=False)
        want.all_ready()
        want_k, want_v = want.keys, want.values
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_sinks_under_stream_semantics_receive_the_chunks_as_stored(llama_adapter, monkeypatch):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    with lazy_streams(monkeypatch) as s:
        chunks = _chunks(inp, s, half=False, pinned=True)
        sinks = [DeviceSink(torch.empty_like(kv.keys), torch.empty_like(kv.values), lambda: None) for kv in chunks]
        feed = LayerFeed(a, inp.prefix, chunks, sinks=sinks, stage=True)
        feed.all_ready()
        for sink, kv in zip(sinks, inp.chunks, strict=True):
            assert torch.equal(sink.keys, kv.keys) and torch.equal(sink.values, kv.values)
    assert s.breaches == []


def test_a_copy_stream_that_does_not_wait_for_the_compute_stream_is_caught(llama_adapter, monkeypatch):
    # the feed's buffer comes from the compute stream's allocator: staging into it without waiting
    # may overwrite memory a previous request's queued kernels still read
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    real = feed_mod._Stager.__init__

    def no_wait(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.after = None

    monkeypatch.setattr(feed_mod._Stager, "__init__", no_wait)
    with lazy_streams(monkeypatch) as s:
        feed = LayerFeed(a, inp.prefix, _chunks(inp, s, half=False, pinned=True), stage=True)
        with pytest.raises(RuntimeError, match="staging chunk caches"):
            feed.ready(0)
    assert any("without waiting for the compute stream" in b for b in s.breaches)


def test_reading_a_layer_before_it_is_ready_is_caught(llama_adapter, monkeypatch):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    with lazy_streams(monkeypatch, hold_s=5.0) as s:
        feed = LayerFeed(a, inp.prefix, _chunks(inp, s, half=False, pinned=True), stage=True)
        last = a.spec.num_layers - 1
        assert feed._worker is not None
        feed._worker.landed[last].wait()  # issued, not waited for: pending on the side stream
        with pytest.raises(StreamBreach, match="pending copy writes"):
            feed.keys[last].sum()
        feed.all_ready()
        feed.keys[last].sum()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_slab_refilled_before_its_copy_ran_is_caught_on_any_copy_thread(llama_adapter, monkeypatch, threads):
    # the stager waits for layer l-2's copy before it refills that slab; without the wait (events
    # that do not wait) and with the compute side not yet reading, the refill lands on a pending copy
    import tests.gpu.stream_safety as fake

    a = llama_adapter
    _, _, _, inp = _prompt(a)
    monkeypatch.setattr(fake._Event, "synchronize", lambda self: None)
    with lazy_streams(monkeypatch, hold_s=0.0) as s:
        feed = LayerFeed(a, inp.prefix, _chunks(inp, s, half=False, pinned=False), stage=True, stage_threads=threads)
        assert feed._worker is not None
        feed._worker.thread.join()
        with pytest.raises(RuntimeError, match="staging chunk caches"):
            feed.all_ready()
    assert any("pending copy still reads" in b for b in s.breaches)


def test_a_fusion_through_a_staged_feed_keeps_stream_semantics(llama_adapter, monkeypatch):
    # every ATen call of the fusion (probe, recompute, suffix) is checked against the pending copies
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    want = fuse(a, inp, FusionConfig(), prefill_suffix=True)
    import ragkv.fusion

    real = ragkv.fusion.LayerFeed
    monkeypatch.setattr(ragkv.fusion, "LayerFeed", lambda *args, **kw: real(*args, **kw, stage=True))
    with lazy_streams(monkeypatch) as s:
        for kv in inp.chunks:
            s.host(kv.keys, pinned=False)
            s.host(kv.values, pinned=False)
        got = fuse(a, inp, FusionConfig(), prefill_suffix=True)
    assert s.breaches == []
    assert got.suffix_logits is not None and want.suffix_logits is not None
    assert torch.equal(got.suffix_logits, want.suffix_logits)
    assert torch.equal(got.selected, want.selected)


@pytest.mark.parametrize("via", ["put", "sink"])
@pytest.mark.parametrize("served", [True, False], ids=["ordered", "control"])
def test_a_device_tier_entry_is_read_on_another_stream_only_after_its_writes(monkeypatch, via, served):
    # a request on a stream of its own reads an entry another request wrote on the compute stream:
    # it waits for the entry's writes and record_streams it (the control: without, it is caught)
    from ragkv.gpu.tier import DeviceTier

    if not served:
        monkeypatch.setattr(DeviceTier, "_served", lambda self, entry: None)
    with lazy_streams(monkeypatch) as s:
        tier = DeviceTier(1 << 20, "cpu")
        kv = ChunkKV(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4), torch.arange(5), "fp")
        if via == "put":
            assert tier.put("k", kv, 0.1)
        else:
            sink = tier.reserve("k", kv, kv.keys.dtype, 0.1)
            assert sink is not None
            sink.keys.copy_(kv.keys)
            sink.values.copy_(kv.values)
            sink.on_filled()
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            got = tier.get("k", fingerprint="fp", dtype=kv.keys.dtype, num_tokens=5)
            assert got is not None
            out = torch.empty_like(got.keys)
            if served:
                out.copy_(got.keys, non_blocking=True)
            else:
                with pytest.raises(StreamBreach, match="without waiting"):
                    out.copy_(got.keys, non_blocking=True)
        reader.synchronize()
    if served:
        assert s.breaches == [] and torch.equal(out, kv.keys)
