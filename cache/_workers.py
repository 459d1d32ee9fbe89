"""A small pool of daemon threads that run one tier's calls, so a caller can stop waiting.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so a call
stuck on a hung mount or socket would hang the process on exit too; daemon threads do not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None


class DaemonPool:
    """Runs submitted calls on ``workers`` daemon threads, started on the first submit."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self._workers = workers
        self._name = name
        self._queue: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the future holds its result or exception."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: pool is shut down")
            if not self._started:
                for i in range(self._workers):
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True).start()
                self._started = True
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Let the threads exit once the queued calls are done; do not wait for them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        for _ in range(self._workers if started else 0):
            self._queue.put(None)

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the waiting caller, not lost
                    future.set_exception(e)
