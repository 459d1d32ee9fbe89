"""Fetching ahead: values arrive in order while the caller works on the ones it already has."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["prefetch"]


def prefetch(keys: Sequence[K], fetch: Callable[[K], V], *, ahead: int = 2) -> Generator[V, None, None]:
    """Yield ``fetch(key)`` for ``keys`` in order, fetching ahead on one background thread.

    While the caller processes value i (say, decodes a chunk cache), values i+1 .. i+``ahead``
    are being fetched (say, read from Redis or object storage), so a tier's latency hides behind
    the caller's work; at most ``ahead`` + 1 values are held at once. ``fetch`` runs on that one
    thread only, in order, so it needs no more thread safety than a single caller would. An
    exception from ``fetch`` is raised where its value would have been yielded. Closing the
    iterator early stops fetching and waits for the fetch in progress, if any. With fewer than
    two keys nothing runs in the background.
    """
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    if len(keys) < 2:
        for key in keys:
            yield fetch(key)
        return
    futures: list[Future[V] | None] = [Future() for _ in keys]
    room = threading.Semaphore(ahead)  # values fetched (or being fetched) and not yet taken
    stop = threading.Event()

    def run() -> None:
        for i, key in enumerate(keys):
            room.acquire()
            future = futures[i]
            if stop.is_set() or future is None:
                return
            try:
                future.set_result(fetch(key))
            except BaseException as e:  # handed to the consumer by future.result()
                future.set_exception(e)

    thread = threading.Thread(target=run, name="ragkv-prefetch", daemon=True)
    thread.start()
    try:
        for i in range(len(futures)):
            future = futures[i]
            assert future is not None
            value = future.result()
            futures[i] = None  # hold no more than the caller does
            room.release()
            yield value
    finally:
        stop.set()
        room.release()  # wake the fetch thread if it waits for room, so it sees the stop
        thread.join()
