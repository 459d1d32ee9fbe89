"""CUDA's stream semantics on the CPU: a copy stream's work runs as late as CUDA lets it.

``ragkv.gpu.feed`` stages host chunks on a copy stream while the compute stream reads the fused
buffer layer by layer. On a CPU nothing is asynchronous: a copy runs when it is called. A missing
wait, a slab overwritten under a pending copy, or a buffer written before the compute stream is done
with its memory then computes right in every CPU test and wrong on a GPU. :func:`lazy_streams`
replaces ``torch.cuda``'s streams and events with fakes under which the CPU runs such code with
CUDA's semantics at their least forgiving:

- A copy into device memory issued on a side stream (by a thread inside ``torch.cuda.stream(side)``)
  is queued, not run. Queued copies run in order, and only when something waits for them: the
  event recorded after them synchronized, the side stream synchronized, or the compute stream told
  to wait (``wait_event``, ``wait_stream``). A side thread's ``synchronize()`` of its whole stream
  first gives the compute side up to :attr:`LazyStreams.hold_s` to run the copies itself, so the
  last layers stay pending while the compute side reads.
- The compute stream (any thread outside a side stream) runs at once, as its kernels would appear
  to a side stream that waits for them.
- Host memory (what :meth:`LazyStreams.host` registers: the chunks, the pool's slabs) is written at
  once, as host copies are.

What CUDA requires of such code is checked as it runs. Each breach is recorded in
:attr:`LazyStreams.breaches` and raised where it happens (as :class:`StreamBreach`):

1. the compute stream touches device memory a pending copy writes, or writes memory a pending copy
   reads (a missing wait);
2. the host writes host memory a pending copy reads, or hands such memory back to the pool (a slab
   reused too early);
3. a side stream reads or writes device memory it did not allocate without ``record_stream`` (the
   allocator may hand it out again while the copy is pending), or without having waited for the
   compute stream after that memory was allocated (the caching allocator may have given it memory
   that queued compute work still uses; memory from before the fake needs some wait), or after
   the compute stream last wrote it (a read) or touched it (a write);
4. a copy from the host reads pageable or non-contiguous memory (torch then copies through a
   pageable temporary, and the copy blocks the host), writes non-contiguous device memory (torch
   then allocates a device temporary and runs a second copy), or is not ``non_blocking``;
5. a side stream runs anything but views, allocations and copies (the fake does not model it), a
   host copy thread (the stager's ``_copy_part`` off the stager's thread) writes device memory, or
   code switches streams by ``torch.cuda.set_stream``.

The host writes of the stager's copy threads are checked against rule 2 as well.

What it cannot see: the copy's speed, the driver, and host memory read through numpy or ctypes (the
host tier's pinned copies, the checksum); the CUDA tests run the real streams.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from ragkv.gpu.feed import PinnedPool

__all__ = ["LazyStreams", "StreamBreach", "lazy_streams"]

aten = torch.ops.aten
_FACTORIES = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)

Span = tuple[int, int]  # [first byte, end) of a tensor's memory


class StreamBreach(AssertionError):
    """Code did what CUDA's streams do not allow: it computed right here and would not on a GPU."""


def _span(t: torch.Tensor) -> Span | None:
    """The bytes ``t`` may touch (first to last element; None when empty)."""
    if t.numel() == 0:
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _overlap(a: Span | None, b: Span | None) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


@dataclass(slots=True)
class _Copy:
    """A copy queued on a side stream."""

    dst: torch.Tensor
    src: torch.Tensor
    inference: bool  # the issuing thread's inference mode (the copy runs in it)
    writes: Span | None
    reads: Span | None

    def run(self) -> None:
        with _disable_current_modes(), torch.inference_mode(self.inference):
            self.dst.copy_(self.src)


class _Stream:
    """A fake ``torch.cuda.Stream``: the compute stream runs at once; a side stream queues copies."""

    def __init__(self, streams: LazyStreams, side: bool) -> None:
        self.streams, self.side = streams, side
        self.queue: list[_Copy | None] = []  # a copy that ran is None: its tensors are let go
        self.ran = 0  # copies of the queue that have run
        self.horizon = -1  # a side stream's last wait for the compute stream (the clock's tick)

    def pending(self) -> list[_Copy]:
        return [c for c in self.queue[self.ran :] if c is not None]

    def run_until(self, end: int) -> None:
        with self.streams.lock:
            while self.ran < end:
                copy = self.queue[self.ran]
                self.queue[self.ran] = None
                self.ran += 1  # no longer pending: its own reads and writes are not checked against it
                if copy is not None:
                    copy.run()
            self.streams.lock.notify_all()

    def wait_event(self, event: _Event) -> None:
        if event.stream is None or event.stream is self:
            return
        if not event.stream.side:  # a side stream waits for the compute stream: all it did so far
            self.horizon = max(self.horizon, event.tick)
        elif self.side:
            raise NotImplementedError("a side stream waiting for another side stream is not modelled")
        else:  # the compute stream waits for a side stream's copies up to the event
            event.stream.run_until(event.position)

    def wait_stream(self, other: _Stream) -> None:
        event = _Event(self.streams)
        event.record(other)
        self.wait_event(event)

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event(self.streams)
        event.record(self)
        return event

    def synchronize(self) -> None:
        end = len(self.queue)
        if self.side and self.streams.on_side_thread():
            # a GPU may be slow: the compute side gets the chance to run the copies first
            deadline = time.monotonic() + self.streams.hold_s
            with self.streams.lock:
                while self.ran < end and time.monotonic() < deadline:
                    self.streams.lock.wait(0.01)
        self.run_until(end)

    def query(self) -> bool:
        return self.ran >= len(self.queue)


class _Event:
    """A fake ``torch.cuda.Event``: a point in a stream's queue (and the clock's tick at recording)."""

    def __init__(self, streams: LazyStreams, *args: Any, **kwargs: Any) -> None:
        self.streams = streams
        self.stream: _Stream | None = None
        self.position = 0
        self.tick = -1

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream or self.streams.current()
        with self.streams.lock:
            self.stream, self.position, self.tick = stream, len(stream.queue), self.streams.now()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        return self.stream is None or self.stream.ran >= self.position

    def wait(self, stream: _Stream | None = None) -> None:
        (stream or self.streams.current()).wait_event(self)


class _SideMode(TorchDispatchMode):
    """Every ATen call a thread makes inside ``torch.cuda.stream(side)``."""

    def __init__(self, streams: LazyStreams, stream: _Stream) -> None:
        super().__init__()
        self.streams, self.stream = streams, stream

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        s = self.streams
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return s.side_copy(self.stream, dst, src, non_blocking)
        if func is aten.is_pinned.default:
            return s.is_pinned(args[0])
        if func.is_view:
            return func(*args, **kwargs)
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            s.allocated(out, self.stream)
            return out
        s.breach(f"{func} on a side stream: the fake models views, allocations and copies only")
        return None  # not reached


class _HostMode(TorchDispatchMode):
    """A thread that only copies on the host (the stager's slab-copy threads): rule 2 on its writes."""

    def __init__(self, streams: LazyStreams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            if not self.streams.is_host(args[0]):
                self.streams.breach("a host copy thread writes device memory outside any stream")
            self.streams.host_write(args[0])
        return func(*args, **kwargs)


class _ComputeMode(TorchDispatchMode):
    """Every ATen call of the thread that entered :func:`lazy_streams` (the compute stream's)."""

    def __init__(self, streams: LazyStreams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return self.streams.is_pinned(args[0])
        if func.is_view:
            return func(*args, **kwargs)
        schema = func._schema
        written = {
            a.name
            for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write  # in-place and out= arguments
        }
        named = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
        for name, value in named.items():
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self.streams.compute_touch(t, write=name in written, op=func)
        out = func(*args, **kwargs)
        if not schema.is_mutable:  # what it returned is new memory unless it is an argument's
            inputs = {
                t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            self.streams.allocated(out, self.streams.compute, skip=inputs)
        return out


@dataclass(eq=False)
class LazyStreams:
    """The fake's state: the streams, what is host memory, what was allocated where, the breaches."""

    hold_s: float = 1.0  # how long a side thread's stream synchronize leaves the copies to the compute side
    breaches: list[str] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=lambda: threading.Condition(threading.RLock()))
    compute: _Stream = field(init=False)
    compute_thread: int = field(default_factory=threading.get_ident)  # the thread that made it
    _streams: list[_Stream] = field(default_factory=list)
    _clock: Iterator[int] = field(default_factory=itertools.count)
    _local: threading.local = field(default_factory=threading.local)
    _host: list[tuple[torch.Tensor, Span, bool]] = field(default_factory=list)  # (kept alive, span, pinned)
    _made: dict[int, tuple[_Stream, int]] = field(default_factory=dict)  # storage -> (stream, tick)
    _recorded: set[tuple[int, int]] = field(default_factory=set)  # (storage, id(stream)) record_stream'd
    _touched: dict[int, list[tuple[Span | None, int, bool]]] = field(
        default_factory=dict
    )  # compute: (span, tick, wrote)

    def __post_init__(self) -> None:
        self.compute = _Stream(self, side=False)

    # -- what the test says ---------------------------------------------------------------------

    def host(self, t: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """Say ``t``'s memory (its whole storage) is the host's, page-locked or not; returns ``t``."""
        storage = t.untyped_storage()
        start = storage.data_ptr()
        with self.lock:
            self._host.append((t, (start, start + storage.nbytes()), pinned))
        return t

    def pool(self, keep: int = 4) -> PinnedPool:
        """A staging pool whose slabs are page-locked host memory, given back only when no copy reads them."""
        return _Pool(self, keep)

    @contextlib.contextmanager
    def peek(self) -> Iterator[None]:
        """Look at memory without being the compute stream (a test checking what has not run yet)."""
        with _disable_current_modes():
            yield

    # -- what the fakes ask -----------------------------------------------------------------------

    def now(self) -> int:
        return next(self._clock)

    def current(self) -> _Stream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.compute

    def on_side_thread(self) -> bool:
        return threading.get_ident() != self.compute_thread

    def is_host(self, t: torch.Tensor) -> bool:
        return self._host_entry(t) is not None

    def is_pinned(self, t: torch.Tensor) -> bool:
        entry = self._host_entry(t)
        return entry is not None and entry[2]

    def _host_entry(self, t: torch.Tensor) -> tuple[torch.Tensor, Span, bool] | None:
        if t.numel() == 0:
            return None
        p = t.data_ptr()
        with self.lock:
            return next((e for e in self._host if e[1][0] <= p < e[1][1]), None)

    def breach(self, why: str) -> None:
        with self.lock:
            self.breaches.append(why)
        raise StreamBreach(why)

    def pending(self) -> list[_Copy]:
        with self.lock:
            return [c for s in self._streams for c in s.pending()]

    def allocated(self, out: Any, stream: _Stream, skip: frozenset[int] | set[int] = frozenset()) -> None:
        tick = self.now()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in skip:
                storage = t.untyped_storage().data_ptr()
                with self.lock:
                    self._made[storage] = (stream, tick)
                    self._touched.pop(storage, None)  # what touched its address before was other memory

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        self._recorded.add((t.untyped_storage().data_ptr(), id(stream)))

    def compute_touch(self, t: torch.Tensor, *, write: bool, op: Any) -> None:
        """Rule 1: the compute stream may not touch what a pending copy writes, nor write what it reads."""
        span = _span(t)
        for c in self.pending():
            if _overlap(span, c.writes):
                self.breach(f"{op} on the compute stream touches memory a side stream's pending copy writes")
            if write and _overlap(span, c.reads):
                self.breach(f"{op} on the compute stream writes memory a side stream's pending copy reads")
        with self.lock:
            self._touched.setdefault(t.untyped_storage().data_ptr(), []).append((span, self.now(), write))

    def host_write(self, dst: torch.Tensor) -> None:
        """Rule 2: the host may not write what a pending copy reads."""
        span = _span(dst)
        if any(_overlap(span, c.reads) for c in self.pending()):
            self.breach("the host writes memory a side stream's pending copy still reads (wait for its event)")

    def side_device(self, stream: _Stream, t: torch.Tensor, *, write: bool) -> None:
        """Rule 3, for device memory ``t`` a copy on side stream ``stream`` writes or reads."""
        storage = t.untyped_storage().data_ptr()
        made = self._made.get(storage)
        if made is not None and made[0] is stream:
            return  # its own allocation: ordered by the stream itself
        what = "writes" if write else "reads"
        tick = 0 if made is None else made[1]  # memory from before the fake needs some wait
        if stream.horizon < tick:
            self.breach(
                f"a side stream {what} device memory the compute stream allocated without waiting for the "
                "compute stream after it (stream.wait_event / wait_stream)"
            )
        span = _span(t)
        with self.lock:
            touched = list(self._touched.get(storage, ()))
        for other, when, wrote in touched:
            if when > stream.horizon and (write or wrote) and _overlap(span, other):
                done = "wrote" if wrote else "read"
                self.breach(
                    f"a side stream {what} device memory the compute stream {done} after the side stream's last wait"
                )
        if (storage, id(stream)) not in self._recorded:
            self.breach(f"a side stream {what} device memory it did not allocate without record_stream")

    def side_copy(self, stream: _Stream, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        dst_host, src_host = self.is_host(dst), self.is_host(src)
        if dst_host and src_host:  # a host copy runs now (rule 2: not under a pending copy's read)
            self.host_write(dst)
            with _disable_current_modes():
                return dst.copy_(src)
        if src_host:  # rule 4
            if not self.is_pinned(src):
                self.breach("a copy from pageable host memory: it blocks the host (stage through pinned memory)")
            if not src.is_contiguous():
                self.breach("a copy from non-contiguous host memory: torch copies it through a pageable temporary")
            if not dst_host and not dst.is_contiguous():
                self.breach(
                    "a copy from the host into non-contiguous device memory: torch allocates a device "
                    "temporary and runs a second copy (land it contiguous, then copy on the device)"
                )
        if (src_host or dst_host) and not non_blocking:
            self.breach("a host-device copy without non_blocking=True blocks the host thread")
        if not dst_host:  # rule 3
            self.side_device(stream, dst, write=True)
        if not src_host:
            self.side_device(stream, src, write=False)
        inference = torch.is_inference_mode_enabled()
        with self.lock:
            stream.queue.append(_Copy(dst, src, inference, _span(dst), _span(src)))
        return dst

    def give_back(self, slab: torch.Tensor) -> None:
        span = _span(slab)
        if any(_overlap(span, c.reads) for c in self.pending()):
            self.breach("a slab went back to the pool while a side stream's pending copy still reads it")

    def push(self, stream: _Stream) -> None:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(stream)

    def pop(self) -> None:
        self._local.stack.pop()

    def new_stream(self) -> _Stream:
        stream = _Stream(self, side=True)
        with self.lock:
            self._streams.append(stream)
        return stream


class _Pool(PinnedPool):
    def __init__(self, streams: LazyStreams, keep: int) -> None:
        super().__init__(keep)
        self.streams = streams

    def take(self, nbytes: int) -> torch.Tensor:
        slab = super().take(nbytes)
        if not self.streams.is_host(slab):
            self.streams.host(slab, pinned=True)
        return slab

    def give(self, slab: torch.Tensor) -> None:
        self.streams.give_back(slab)
        super().give(slab)


@contextlib.contextmanager
def lazy_streams(monkeypatch: pytest.MonkeyPatch, hold_s: float = 1.0) -> Iterator[LazyStreams]:
    """Run the block with ``torch.cuda``'s streams and events faked (see the module docstring).

    ``ragkv.gpu.feed`` stages through streams as for CUDA, its default pool is the fake's, the
    device tier orders readers after its entries' writes as on CUDA, and the calling thread's ATen
    calls are the compute stream's (checked against pending copies).
    """
    import ragkv.gpu.feed as feed
    import ragkv.gpu.tier as tier

    s = LazyStreams(hold_s=hold_s)

    @contextlib.contextmanager
    def stream_ctx(stream: _Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        s.push(stream)
        mode = _SideMode(s, stream) if stream.side else None
        try:
            if mode is None:
                yield
            else:
                with mode:
                    yield
        finally:
            s.pop()

    def record_stream(t: torch.Tensor, stream: _Stream) -> None:
        s.record_stream(t, stream)

    def set_stream(stream: Any) -> None:
        s.breach("torch.cuda.set_stream: the fake follows streams set by torch.cuda.stream(...) only")

    real_part = feed._Stager._copy_part

    def copy_part(self: Any, *args: Any, **kwargs: Any) -> None:
        if s.current().side:  # on the stager's thread, inside its stream: the side mode watches it
            real_part(self, *args, **kwargs)
            return
        with _HostMode(s):  # a slab-copy thread
            real_part(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: s.new_stream())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(s))
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: s.current())
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(feed._Stager, "_copy_part", copy_part)
    monkeypatch.setattr(feed, "_uses_streams", lambda device: True)
    monkeypatch.setattr(tier, "_uses_streams", lambda device: True)
    monkeypatch.setattr(feed, "_is_pinned", s.is_pinned)
    monkeypatch.setattr(feed, "_POOL", s.pool())
    with _ComputeMode(s):
        yield s
