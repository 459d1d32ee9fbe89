"""The fused context's buffer, filled layer by layer: batched re-rotation, pinned staging, a copy stream.

Fusion reads its context one layer at a time (the question probe, then the recompute), so the
chunks' K/V need only be in place one layer before it. :class:`LayerFeed` allocates the buffer
``[layers, kv_heads, tokens + extra, head_dim]`` and makes layer ``l`` ready when fusion asks
(:meth:`LayerFeed.ready`):

- chunks already on the model's device (device-tier hits, or decoded there) are copied in at
  once, one copy per chunk;
- chunks on the host (a model on a GPU) are staged by a worker thread, layer by layer: every
  host chunk's layer-``l`` K/V into a page-locked slab (:class:`PinnedPool`, reused across
  requests: pinning per request costs more than the copy) in their stored dtype (a memcpy; with
  ``RAGKV_STAGE_THREADS`` > 1 split over that many threads, off until measured), then
  across in one copy and converted into the buffer on a copy stream, with an event per layer.
  ``ready(l)`` makes the compute stream wait for layer ``l``'s event only, so later layers
  cross PCIe while earlier ones compute (CacheBlend's loading pipeline, LMCache's layer-wise
  mode). Pageable memory reaches a GPU at ~6 GB/s, pinned at ~25-50. Chunks already page-locked
  (host-tier hits) need no slab: each chunk's layer crosses by DMA from where it is into a
  contiguous block of a landing buffer, then is copied into its slots on the device;
- then layer ``l``'s chunk keys are re-rotated in one pass per run of chunks that move (the
  first chunk after the prefix usually sits where it was computed), not a loop over chunks,
  in fp32 with the model's own rotation (``ragkv.model.rotary``): the same arithmetic as
  ``ModelAdapter.rerotate``, so the buffer equals the one chunk-by-chunk placement builds.

Device-tier admissions ride along: a :class:`DeviceSink` given for a host chunk receives its
layers as they land, before re-rotation (the entry then equals what decoding gives).

The copy stream starts after an event the compute stream records once the buffer is made (the
caching allocator may hand the buffer memory that queued compute work still uses), and each layer
crosses from the slab in one contiguous copy (torch copies a strided host source through a pageable
temporary that blocks the host).

On a CPU everything but the thread is the same; ``stage=True`` runs the worker there too, which is
how the tests check that the pipelined buffer equals the one filled in one go.
``tests/gpu/stream_safety.py`` fakes CUDA's streams and events on the CPU, copies queued until
something waits for them, and checks the ordering rules above as the worker runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ragkv.gpu import kernels
from ragkv.gpu.attention import attention_kernel
from ragkv.model import ModelAdapter
from ragkv.model.rotary import RotaryFn, turn_keys, turn_tables
from ragkv.types import ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["DeviceSink", "LayerFeed", "PinnedPool", "pinned_pool"]


@dataclass(frozen=True, slots=True, weakref_slot=True)  # the tier frees a reservation whose sink is dropped
class DeviceSink:
    """Device tensors a host chunk's K/V are copied into as they land: a device-tier entry being filled."""

    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], the model's dtype and device
    values: torch.Tensor  # same
    on_filled: Callable[[], None]  # called once every layer is in (the tier then serves the entry)


class PinnedPool:
    """Page-locked host slabs, reused across requests (``cudaHostAlloc`` of 100 MB costs milliseconds).

    ``take`` hands a slab to one user until ``give`` returns it; at most ``keep`` idle slabs stay.
    Without CUDA the slabs are plain host memory (the CPU tests run the same code).
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 slab of at least ``nbytes`` (the smallest idle one that fits, else a new one)."""
        with self._lock:
            fits = [s for s in self._idle if s.numel() >= nbytes]
            if fits:
                slab = min(fits, key=lambda s: s.numel())
                self._idle.remove(slab)
                return slab
        pin = torch.cuda.is_available()
        return torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=pin)

    def give(self, slab: torch.Tensor) -> None:
        """Return ``slab``; the smallest idle slabs are dropped beyond ``keep``."""
        with self._lock:
            self._idle.append(slab)
            self._idle.sort(key=lambda s: s.numel(), reverse=True)
            del self._idle[self.keep :]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.numel() for s in self._idle)


_POOL = PinnedPool()


def pinned_pool() -> PinnedPool:
    """The process's pool of staging slabs."""
    return _POOL


class LayerFeed:
    """The naively placed context ``[layers, kv_heads, n_ctx + extra, head_dim]``, ready layer by layer.

    Args:
        adapter: the model (its device, dtype, shape and rotary module).
        prefix: the shared prefix's exact KV (positions 0..P-1).
        chunks: each chunk's KV at the positions it was computed at, on the model's device or the host.
        extra: free slots after the context (zeroed: the suffix's K/V go there).
        sinks: per chunk, a device-tier entry to fill as the chunk lands, or None.
        stage: stage every chunk through the worker (True), none (False), the chunks not on the
            model's device (None), or per chunk (a bool each).
        pool: where staging slabs come from (the process's pool by default).
        stage_threads: threads that copy a layer's host chunks into the slab side by side (None:
            ``RAGKV_STAGE_THREADS``, default 1: the worker alone). Off by default until measured on
            a GPU host (``ragkv bench gpu``'s "host slab GB/s" against "host slab on threads GB/s").
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        prefix: ChunkKV,
        chunks: Sequence[ChunkKV],
        extra: int = 0,
        *,
        sinks: Sequence[DeviceSink | None] = (),
        stage: bool | Sequence[bool] | None = None,
        pool: PinnedPool | None = None,
        stage_threads: int | None = None,
    ) -> None:
        s, dev = adapter.spec, adapter.device
        self.adapter, self.num_layers = adapter, s.num_layers
        self.n_prefix = prefix.num_tokens
        starts = [self.n_prefix]
        for kv in chunks:
            starts.append(starts[-1] + kv.num_tokens)
        self.n_ctx = starts[-1]
        shape = (s.num_layers, s.num_kv_heads, self.n_ctx + extra, s.head_dim)
        self.keys = torch.empty(shape, dtype=adapter.dtype, device=dev)
        self.values = torch.empty(shape, dtype=adapter.dtype, device=dev)
        # free slots must hold finite numbers: a masked slot still multiplies its value by 0
        self.keys[:, :, self.n_ctx :].zero_()
        self.values[:, :, self.n_ctx :].zero_()
        self.keys[:, :, : self.n_prefix].copy_(prefix.keys)
        self.values[:, :, : self.n_prefix].copy_(prefix.values)
        spans = list(zip(starts[:-1], starts[1:], strict=True))  # each chunk's slots
        if stage is None:
            staged = [kv.keys.device != dev for kv in chunks]
        elif not isinstance(stage, Sequence) and getattr(stage, "ndim", 0) == 0:  # one for all (numpy's bool too)
            staged = [bool(stage)] * len(chunks)
        else:  # per chunk: a sequence, or an array with a dimension
            staged = [bool(st) for st in stage]  # type: ignore[union-attr]  # not a bool: tested above
            if len(staged) != len(chunks):
                raise ValueError(f"stage says {len(staged)} chunks' staging; the feed has {len(chunks)} chunks")
        for kv, (a, b), st in zip(chunks, spans, staged, strict=True):
            if not st:  # on the device already: all layers now, one copy per chunk
                self.keys[:, :, a:b].copy_(kv.keys)
                self.values[:, :, a:b].copy_(kv.values)
        self._runs = _rotation_runs(adapter, chunks, spans)
        self._kernel = bool(self._runs) and kernel_turns(adapter)
        self._sinks = [(a, b, sk) for (a, b), sk in zip(spans, sinks, strict=False) if sk is not None]
        rotated = adapter.rotated_layers
        self._rotated = [True] * s.num_layers if rotated is None else [bool(r) for r in rotated.tolist()]
        self._done = [False] * s.num_layers
        self._worker: _Stager | None = None
        host = [(kv, span) for kv, span, st in zip(chunks, spans, staged, strict=True) if st]
        if host:
            self._worker = _Stager(self, host, pool or _POOL, _stage_threads(stage_threads))
            self._worker.start()

    def ready(self, layer: int) -> None:
        """Make layer ``layer`` complete on the compute stream: landed, copied to sinks, re-rotated."""
        if self._done[layer]:
            return
        if self._worker is not None:
            self._worker.wait(layer)
        for a, b, sink in self._sinks:  # before re-rotation: the entry is what decoding gave
            sink.keys[layer].copy_(self.keys[layer, :, a:b])
            sink.values[layer].copy_(self.values[layer, :, a:b])
        if self._rotated[layer]:
            for a, b, cos_d, sin_d in self._runs:
                k = self.keys[layer : layer + 1, :, a:b]  # [1, H, run, D]
                if not (self._kernel and kernels.fits(k, cos_d, sin_d) and self._turn_with_kernel(k, cos_d, sin_d)):
                    _turn_with_torch(k, cos_d, sin_d, self.adapter.rotary_fn)
        self._done[layer] = True
        if all(self._done):
            self._filled()

    def _turn_with_kernel(self, k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor) -> bool:
        """Turn ``k`` with ragkv's Triton kernel (the same numbers as torch, one pass: ``ragkv.gpu.kernels``);
        False, ``k`` untouched, where Triton refuses the call (a shape its check on the model did not
        compile, say): this feed and later ones of the model then turn keys through torch (logged)."""
        try:
            kernels.turn_keys_(k, cos_d, sin_d)
        except Exception as e:  # Triton's own errors (CompilationError, PTXASError, OutOfResources) included
            logger.warning("ragkv's Triton re-rotation failed (%s): placement turns keys through torch from now on", e)
            self._kernel = False
            with _KERNEL_LOCK:
                _KERNEL_CHECKS[self.adapter] = False
            return False
        return True

    def cancel(self) -> None:
        """Stop staging (a pass that failed or was abandoned): the worker ends after the layer it is
        on and drops its hold on the buffer; returns once it has."""
        if self._worker is not None:
            self._worker.stop()

    def all_ready(self) -> None:
        """Every layer complete (what a caller that reads the whole buffer needs)."""
        for layer in range(self.num_layers):
            self.ready(layer)

    def _filled(self) -> None:
        # the worker is not joined: it ends on its own once its stream drains (a join here would
        # block the compute side's host thread on the last copy)
        sinks, self._sinks = self._sinks, []
        for _, _, sink in sinks:
            sink.on_filled()


def _rotation_runs(
    adapter: ModelAdapter, chunks: Sequence[ChunkKV], spans: Sequence[tuple[int, int]]
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(start, end, cos_d, sin_d)`` per run of consecutive chunks whose stored positions are not
    their slots; the tables ``[1, run, rot_dim]`` fp32 on the device (one rotary call per run)."""
    runs: list[list[int]] = []  # chunk indices
    for i, (kv, (a, b)) in enumerate(zip(chunks, spans, strict=True)):
        if torch.equal(kv.positions.cpu(), torch.arange(a, b)):
            continue  # computed where it goes: kept bit for bit, as ModelAdapter.rerotate does
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:
        start, end = spans[run[0]][0], spans[run[-1]][1]
        src = torch.cat([chunks[i].positions.cpu().to(torch.long) for i in run])
        cos_p, sin_p = adapter.rotary(src)
        cos_q, sin_q = adapter.rotary(torch.arange(start, end))
        out.append((start, end, *turn_tables(cos_p, sin_p, cos_q, sin_q)))
    return out


class _Stager:
    """The worker that moves host chunks into a feed's buffer, layer by layer, through pinned slabs."""

    def __init__(
        self, feed: LayerFeed, host: list[tuple[ChunkKV, tuple[int, int]]], pool: PinnedPool, threads: int = 1
    ) -> None:
        # the buffer's tensors, not the feed: a stager that held its feed would make a reference
        # cycle, and the buffer (gigabytes on a GPU) would wait for the garbage collector
        self.keys, self.values, self.host, self.pool = feed.keys, feed.values, host, pool
        self.device = feed.keys.device
        self.cuda = _uses_streams(self.device)
        # made on the compute thread once the buffer is allocated and its prefix written: the copy
        # stream starts after it. The caching allocator may have handed the buffer memory that work
        # still queued on the compute stream reads or writes (a previous request's), and a write
        # from another stream is not ordered after that work unless it waits for it.
        self.after: torch.cuda.Event | None = None
        if self.cuda:
            self.after = torch.cuda.Event()
            self.after.record(torch.cuda.current_stream(self.device))
        self.landed = [threading.Event() for _ in range(feed.num_layers)]
        self.events: list[torch.cuda.Event | None] = [None] * feed.num_layers
        self.error: BaseException | None = None
        self.stopped = False  # set by stop(): the run ends before its next layer
        # inference mode is per thread: the worker writes the buffer in the mode it was made in
        self.inference = torch.is_inference_mode_enabled()
        self.thread = threading.Thread(target=self._run, name="ragkv-stage", daemon=True)
        # runs of host chunks next to each other in the buffer: one copy each per layer
        self.runs: list[tuple[int, int, int]] = []  # (buffer start, buffer end, slab column)
        self.slab_columns: list[int] = []  # each host chunk's first slab column
        col = 0
        for kv, (a, b) in host:
            self.slab_columns.append(col)
            if self.runs and self.runs[-1][1] == a:
                s, _, c = self.runs[-1]
                self.runs[-1] = (s, b, c)
            else:
                self.runs.append((a, b, col))
            col += kv.num_tokens
        self.columns = col
        # with copy threads, each takes every threads-th host chunk of a layer
        self.copiers = _copiers(threads) if threads > 1 and len(host) > 1 else None
        self.parts = [range(i, len(host), threads) for i in range(min(threads, len(host)))]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """End the run after the layer it is on (the rest never land) and wait for it."""
        self.stopped = True
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` was issued, then order the compute stream after its copy."""
        self.landed[layer].wait()
        if self.error is not None:
            why = f"staging chunk caches to {self.device} failed: {self.error}"
            if isinstance(self.error, torch.OutOfMemoryError):  # the answer path retries these
                raise torch.OutOfMemoryError(why) from self.error
            raise RuntimeError(why) from self.error
        if self.stopped:
            raise RuntimeError("staging was stopped: the pass that read this buffer ended")
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _run(self) -> None:
        keys, values = self.keys, self.values
        self.keys = self.values = None  # type: ignore[assignment]  # held by this run only, freed with it
        # The slab holds the chunks in their stored dtype (fp16 for raw chunks of a bf16 model): the
        # host side is then a plain memcpy, and the conversion runs on the device, where it is a
        # pass at memory bandwidth (on the host it halved the staging rate).
        stored = {kv.keys.dtype for kv, _ in self.host} | {kv.values.dtype for kv, _ in self.host}
        src = stored.pop() if len(stored) == 1 else keys.dtype
        layer_shape = (2, keys.shape[1], self.columns, keys.shape[3])  # K and V of one layer
        nbytes = 2 * keys.shape[1] * self.columns * keys.shape[3] * src.itemsize
        slabs: list[torch.Tensor] = []
        stream = torch.cuda.Stream(keys.device) if self.cuda else None
        # chunks already in page-locked memory cross straight from there: no slab, no host copy
        direct = all(_crosses_directly(kv.keys) and _crosses_directly(kv.values) for kv, _ in self.host)
        try:
            if not direct:  # double-buffered: fill one while the other crosses
                slabs = [self.pool.take(nbytes) for _ in range(2)]
            if stream is not None:  # the buffer is written on this stream: the allocator must know
                if self.after is not None:
                    stream.wait_event(self.after)
                keys.record_stream(stream)
                values.record_stream(stream)
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx, torch.inference_mode(self.inference):
                # A layer lands here contiguous, then is converted or copied into the buffer on the
                # device; the stream orders each landing after the previous layer's conversion.
                # torch copies a strided host source through a pageable temporary (a copy that
                # blocks the host), and into a strided device destination through a device
                # temporary and a second copy: the slab's layer crosses whole, and each pinned
                # chunk's layer into a contiguous block of its own.
                if direct:  # each chunk's block in its own dtype: its DMA is a plain copy
                    blocks, size = _direct_blocks(self.host)
                    landing = torch.empty(size, dtype=torch.uint8, device=self.device)
                else:
                    blocks, landing = [], torch.empty(layer_shape, dtype=src, device=self.device)
                for layer in range(len(self.landed)):
                    if self.stopped:
                        break
                    if direct:
                        self._cross_direct(layer, keys, values, landing, blocks)
                    else:
                        if layer >= 2 and self.events[layer - 2] is not None:
                            self.events[layer - 2].synchronize()  # type: ignore[union-attr]  # slab's last copy done
                        view = slabs[layer % 2][:nbytes].view(src).view(layer_shape)
                        self._to_slab(layer, view)
                        landing.copy_(view, non_blocking=True)
                        self._convert(layer, keys, values, landing)
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                        self.events[layer] = event
                    self.landed[layer].set()
        except BaseException as e:  # the compute side raises it at its next wait
            logger.warning("staging chunk caches failed: %s", e)
            self.error = e
        finally:
            for flag in self.landed:
                flag.set()
            if stream is not None:  # no copy may still read a slab that goes back to the pool
                with contextlib.suppress(Exception):
                    stream.synchronize()
            for slab in slabs:
                self.pool.give(slab)
            self.host = []  # the host chunks' memory is theirs again

    def _to_slab(self, layer: int, view: torch.Tensor) -> None:
        """Layer ``layer`` of every host chunk into the slab ``view`` ``[2, H, columns, D]``: on this
        thread, or split over the copy threads (disjoint columns; torch's copies release the GIL)."""
        if self.copiers is None:
            self._copy_part(layer, view, range(len(self.host)))
            return
        done = [self.copiers.submit(self._copy_part, layer, view, part) for part in self.parts]
        wait(done)  # all of them, failed or not, before the slab may go back to the pool
        for f in done:
            f.result()

    def _copy_part(self, layer: int, view: torch.Tensor, part: range) -> None:
        with torch.inference_mode(self.inference):
            for i in part:
                kv, col = self.host[i][0], self.slab_columns[i]
                view[0, :, col : col + kv.num_tokens].copy_(kv.keys[layer])
                view[1, :, col : col + kv.num_tokens].copy_(kv.values[layer])

    def _convert(self, layer: int, keys: torch.Tensor, values: torch.Tensor, crossed: torch.Tensor) -> None:
        """Layer ``layer`` of the host runs, from ``crossed`` ``[2, H, columns, D]`` into the buffer."""
        for a, b, c in self.runs:  # converted to the model's dtype on the way (on the device)
            keys[layer, :, a:b].copy_(crossed[0, :, c : c + b - a], non_blocking=True)
            values[layer, :, a:b].copy_(crossed[1, :, c : c + b - a], non_blocking=True)

    def _cross_direct(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        landing: torch.Tensor,
        blocks: list[tuple[int, int]],
    ) -> None:
        """Layer ``layer`` of pinned host chunks: copied from where they are (DMA), each K and V into
        a contiguous block of the byte buffer ``landing`` in its own dtype (at ``blocks``' offsets),
        then every chunk copied (converted) into its slots on the device: the DMAs run back to back,
        one device copy each."""
        landed = []
        for (kv, _), offsets in zip(self.host, blocks, strict=True):
            pair = []
            for t, at in zip((kv.keys[layer], kv.values[layer]), offsets, strict=True):
                block = landing[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                block.copy_(t, non_blocking=True)
                pair.append(block)
            landed.append(pair)
        for (_, (a, b)), (block_k, block_v) in zip(self.host, landed, strict=True):
            keys[layer, :, a:b].copy_(block_k, non_blocking=True)
            values[layer, :, a:b].copy_(block_v, non_blocking=True)


_COPIERS: dict[int, ThreadPoolExecutor] = {}
_COPIERS_LOCK = threading.Lock()


def _copiers(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` slab-copy threads (shared by every feed)."""
    with _COPIERS_LOCK:
        pool = _COPIERS.get(threads)
        if pool is None:
            pool = _COPIERS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="ragkv-slab")
        return pool


def _stage_threads(threads: int | None) -> int:
    """``threads``, or ``RAGKV_STAGE_THREADS`` (default 1) where None; at least 1."""
    name = "stage_threads"
    if threads is None:
        name, raw = "RAGKV_STAGE_THREADS", os.environ.get("RAGKV_STAGE_THREADS", "1").strip()
        try:
            threads = int(raw)
        except ValueError:
            raise ValueError(f"RAGKV_STAGE_THREADS must be a whole number of threads (1: none), got {raw!r}") from None
    if threads < 1:
        raise ValueError(f"{name} must be at least 1 (the staging worker alone), got {threads}")
    return threads


def _direct_blocks(host: Sequence[tuple[ChunkKV, tuple[int, int]]]) -> tuple[list[tuple[int, int]], int]:
    """Byte offsets of each host chunk's one-layer K and V blocks in a landing buffer, and its
    size: each block in the chunk's own dtype, 16-byte aligned (any dtype can view it)."""
    blocks, at = [], 0
    for kv, _ in host:
        pair = []
        for t in (kv.keys, kv.values):
            pair.append(at)
            at += -(-t[0].numel() * t.element_size() // 16) * 16
        blocks.append((pair[0], pair[1]))
    return blocks, at


def _turn_with_torch(k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor, rotary_fn: RotaryFn | None) -> None:
    """Turn keys ``k`` ``[1, H, run, D]`` in place through torch and the model's own rotation function."""
    src = k if _turns_as_stored(k.device) else k.float()
    k.copy_(turn_keys(src, cos_d, sin_d, rotary_fn))


# Devices whose placement may turn keys with ragkv's Triton kernel (the tests add "cpu": Triton's interpreter).
_KERNEL_DEVICES: tuple[str, ...] = ("cuda",)
_KERNEL_CHECKS: weakref.WeakKeyDictionary[ModelAdapter, bool] = weakref.WeakKeyDictionary()
_KERNEL_LOCK = threading.Lock()


def kernel_turns(adapter: ModelAdapter) -> bool:
    """Whether placement turns this model's keys with :func:`ragkv.gpu.kernels.turn_keys_`: on a GPU, Triton
    there and not switched off (``RAGKV_TRITON=0``), and the kernel reproducing the model's own rotation
    bit for bit on a test (:func:`_check_kernel`, once per model)."""
    if adapter.device.type not in _KERNEL_DEVICES or not kernels.enabled():
        return False
    with _KERNEL_LOCK:
        ok = _KERNEL_CHECKS.get(adapter)
        if ok is None:
            ok = _KERNEL_CHECKS[adapter] = _check_kernel(adapter)
        return ok


def warm_kernels(adapter: ModelAdapter) -> None:
    """Compile and check ragkv's Triton kernels for ``adapter`` now (a server's start, a bench before
    timing), not in the first request: placement's (:func:`kernel_turns`), the probe's
    (:func:`ragkv.gpu.kernels.probe_scale_mask`) and the recompute's attention
    (:func:`ragkv.gpu.attention.attention_kernel`: checked, and timed against SDPA). A wrong
    ``RAGKV_TRITON`` or ``RAGKV_ATTENTION_KERNEL`` raises here."""
    kernel_turns(adapter)
    kernels.probe_scale_mask(adapter.device)
    attention_kernel(adapter)


def _check_kernel(adapter: ModelAdapter, rows: int = 48) -> bool:
    """Turn random keys in the model's dtype from one run of positions to another with the kernel and
    through torch with the model's rotation function: True where the two agree bit for bit. A
    layout the kernel does not compute (interleaved or partial rotary, a scaled variant that rounds
    on its own) fails here and keeps torch; so does a kernel that fails to compile or run."""
    s, a_dev = adapter.spec, adapter.device
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn((1, s.num_kv_heads, rows, s.head_dim), generator=gen) * 8
    keys[..., ::7, ::5] = -0.0  # a sign a kernel could lose
    keys = keys.to(adapter.dtype).to(adapter.device)
    moved, there = adapter.rotary(torch.arange(900, 900 + rows)), adapter.rotary(torch.arange(3, 3 + rows))
    cos_d, sin_d = turn_tables(*moved, *there)
    if not kernels.fits(keys, cos_d, sin_d):
        return False
    want, got = keys.clone(), keys.clone()
    _turn_with_torch(want, cos_d, sin_d, adapter.rotary_fn)
    try:
        kernels.turn_keys_(got, cos_d, sin_d)
    except Exception as e:  # a Triton that cannot compile for this device, say: torch turns the keys
        logger.warning("ragkv's Triton re-rotation failed on %s (%s): placement turns keys through torch", a_dev, e)
        return False
    as_bits = {2: torch.int16, 4: torch.int32}.get(got.element_size())
    ok = torch.equal(got.view(as_bits), want.view(as_bits)) if as_bits else torch.equal(got, want)  # -0 is not +0
    if not ok:
        logger.info("ragkv's Triton re-rotation differs from this model's rotation: placement turns keys through torch")
    return ok


def _turns_as_stored(device: torch.device) -> bool:
    """Whether placement turns half-precision keys as they are stored rather than an fp32 copy of them.

    The same numbers either way: the rotation tables are fp32, so each product promotes to fp32,
    and a bf16 or fp16 key converts to fp32 exactly (``rotate_half``'s negation and concatenation
    are exact in any width; a rotation that rounds to the keys' dtype itself, OLMo 2's, rounds the
    same fp32 result the copy into the buffer would). CUDA's kernels convert as they read, so
    there it saves a full fp32 copy of every moved key per layer (17% of placement's bytes,
    ``experiments/gpu_traffic.py``). On a CPU torch first converts a mixed-dtype product's half
    input into an fp32 temporary, once for the keys and once for their rotated half: no clear gain
    over the one copy there (``experiments/turn_keys_cpu.py``), so the CPU keeps turning ``k.float()``.
    """
    return device.type == "cuda"


def _uses_streams(device: torch.device) -> bool:
    """Whether staging to ``device`` runs on a copy stream with events (CUDA; the stream tests make
    the CPU say yes, with CUDA's semantics faked: ``tests/gpu/stream_safety.py``)."""
    return device.type == "cuda"


def _crosses_directly(t: torch.Tensor) -> bool:
    """True for a host chunk tensor the copy stream can read by DMA where it is: page-locked, and
    contiguous (so is each layer; a strided one would go through a pageable temporary)."""
    return _is_pinned(t) and t.is_contiguous()


def _is_pinned(t: torch.Tensor) -> bool:
    """True for a host tensor in page-locked memory (never without CUDA)."""
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()
