"""Fetching ahead: values arrive in order while the caller works on the ones it already has."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["prefetch"]


def prefetch(keys: Sequence[K], fetch: Callable[[K], V]) -> Iterator[V]:
    """Yield ``fetch(key)`` for ``keys`` in order, fetching ahead on one background thread.

    While the caller processes value i (say, decodes a chunk cache), values i+1, ... are being
    fetched (say, read from Redis or object storage), so a tier's latency hides behind the
    caller's work. ``fetch`` runs on that one thread only, in order, so it needs no more thread
    safety than a single caller would. An exception from ``fetch`` is raised where its value
    would have been yielded. Closing the iterator early waits for the fetches already started.
    With fewer than two keys nothing runs in the background.
    """
    if len(keys) < 2:
        for key in keys:
            yield fetch(key)
        return
    futures: list[Future[V]] = [Future() for _ in keys]

    def run() -> None:
        for key, future in zip(keys, futures, strict=True):
            try:
                future.set_result(fetch(key))
            except BaseException as e:  # handed to the consumer by future.result()
                future.set_exception(e)

    thread = threading.Thread(target=run, name="ragkv-prefetch", daemon=True)
    thread.start()
    try:
        for future in futures:
            yield future.result()
    finally:
        thread.join()
