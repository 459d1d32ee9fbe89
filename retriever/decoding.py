"""Decoding a request's chunk caches on several threads at once, results kept in order.

A request's chunks decode one after another on the query thread otherwise. For raw chunks a
decode is mostly the payload checksum (xxh3), for entropy-coded ones zstd and a multiply in
numpy: all three release the GIL, so chunks decode side by side. On a GPU host (16 cores or more)
checking 2.1 GB of raw chunks of a 16K-token prompt took 275-351 ms on one thread, over 40% of
that request's TTFT from host memory (docs/benchmarks.md, "GPU").

The pools are the process's (one per worker count), shared by every request (a task never waits
for another task of its pool, so no request can starve another's decode into a deadlock), and are
separate from the entropy stage's pool, which a cachegen decode waits on from inside a task here.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

__all__ = ["DEFAULT_WORKERS", "OrderedDecodes", "decode_all", "default_workers"]

T = TypeVar("T")
K = TypeVar("K")


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Half the cores, 1 to 8: the other half is left to what runs meanwhile (the fetch thread, a
# chunk prefilled here, the entropy stage's own pool). On 2 cores that is 1: decodes run inline,
# as before (two threads measured 1.24x on raw chunks kept as views there, 0.98x converted to bf16
# and 1.05x on cachegen's, whose entropy stage already takes both cores).
DEFAULT_WORKERS = max(1, min(8, _cores() // 2))


def default_workers(device_type: str) -> int:
    """The decode threads a request gets by default for a model on ``device_type`` ("cuda", "cpu",
    ...): :data:`DEFAULT_WORKERS` on a GPU; 1 elsewhere, where decodes would compete with torch's
    own threads for no measured gain (docs/gpu.md, "Decode threads")."""
    return DEFAULT_WORKERS if device_type == "cuda" else 1


# One pool per worker count, never shut down: a pool is exactly as wide as the callers asking for
# it, so ``workers`` bounds the decodes running at once, and no caller can find its pool gone.
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _forget_pools() -> None:
    # A forked child inherits the pool objects but not their threads: its jobs would wait forever.
    global _POOL_LOCK
    _POOLS.clear()
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool of exactly ``workers`` decode threads."""
    with _POOL_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ragkv-decode")
        return pool


class OrderedDecodes(Generic[K, T]):
    """Calls submitted in order, run on up to ``workers`` threads, their results taken back in order.

    At most ``2 * workers`` calls are in flight: :meth:`submit` hands back the oldest ones beyond
    that (waiting for them), so a request holds a bounded number of fetched blobs while its chunks
    decode. With one worker every call runs inline, on the caller's thread, and :meth:`submit`
    hands its result back at once.

    ``around`` makes the context each call on a worker thread runs in: the loader passes the
    request's CUDA stream (``torch.cuda.stream(s)``), so a decode onto the GPU uploads on the
    stream that will read the result. A thread's current stream is its own, the device's default
    one on a new thread; a request running on another stream would otherwise read uploads not
    ordered before it.

    An exception raised by a call is raised where its result is taken back.
    """

    def __init__(self, workers: int, around: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1 thread, got {workers}")
        self.workers = workers
        self.around = around
        self._pending: deque[tuple[K, Future[T]]] = deque()

    def submit(self, tag: K, call: Callable[[], T]) -> list[tuple[K, T]]:
        """Start ``call`` (tagged ``tag``); the (tag, result) pairs now taken back, oldest first."""
        future: Future[T]
        if self.workers == 1:
            future = Future()
            try:
                future.set_result(call())
            except BaseException as e:  # raised where it is taken back, as from a thread
                future.set_exception(e)
        else:
            future = _pool(self.workers).submit(
                call if self.around is None else functools.partial(_within, self.around, call)
            )
        self._pending.append((tag, future))
        done = []
        while len(self._pending) > (0 if self.workers == 1 else 2 * self.workers):
            done.append(self._take())
        return done

    def finish(self) -> list[tuple[K, T]]:
        """Every remaining (tag, result) pair, in submission order (waits for them)."""
        return [self._take() for _ in range(len(self._pending))]

    def cancel(self) -> None:
        """Forget what is still pending (the query failed): calls not started are not run, and those
        running are waited for (nothing of the request runs after it has failed)."""
        running = []
        while self._pending:
            future = self._pending.popleft()[1]
            if not future.cancel():
                running.append(future)
        wait(running)

    def _take(self) -> tuple[K, T]:
        tag, future = self._pending.popleft()
        return tag, future.result()


def _within(around: Callable[[], AbstractContextManager[Any]], call: Callable[[], T]) -> T:
    with around():
        return call()


def decode_all(
    calls: Sequence[Callable[[], T]],
    workers: int = DEFAULT_WORKERS,
    around: Callable[[], AbstractContextManager[Any]] | None = None,
) -> list[T]:
    """Every call's result, in order, the calls run as the loader runs a request's decodes (for
    decodes onto a GPU from a stream other than the default one, pass ``around`` as the loader
    does: see :class:`OrderedDecodes`)."""
    decodes: OrderedDecodes[int, T] = OrderedDecodes(workers, around=around)
    out: list[T] = []
    try:
        for i, call in enumerate(calls):
            out.extend(r for _, r in decodes.submit(i, call))
        out.extend(r for _, r in decodes.finish())
    finally:
        decodes.cancel()
    return out
