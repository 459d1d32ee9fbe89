"""prefetch: values in order, fetched ahead on one thread, errors where they belong."""

from __future__ import annotations

import threading

import pytest

from ragkv.retriever.prefetch import prefetch


def test_values_come_in_order_and_equal_fetching_one_by_one() -> None:
    keys = list(range(20))
    assert list(prefetch(keys, lambda k: k * k)) == [k * k for k in keys]
    assert list(prefetch([], lambda k: k)) == []
    assert list(prefetch([3], lambda k: -k)) == [-3]


def test_fetching_runs_ahead_of_the_consumer() -> None:
    """The last key's fetch waits until the consumer holds the first value: a loader that fetched
    everything before handing anything out would time out here."""
    got_first = threading.Event()
    waited: list[bool] = []

    def fetch(key: int) -> int:
        if key == 2:
            waited.append(got_first.wait(timeout=30))
        return key

    out = []
    for value in prefetch([0, 1, 2], fetch):
        out.append(value)
        got_first.set()
    assert out == [0, 1, 2] and waited == [True]


def test_a_failed_fetch_raises_where_its_value_would_be() -> None:
    def fetch(key: int) -> int:
        if key == 1:
            raise OSError("tier down")
        return key

    it = prefetch([0, 1, 2], fetch)
    assert next(it) == 0
    with pytest.raises(OSError, match="tier down"):
        next(it)


def test_fetch_runs_on_one_thread_in_order_and_closing_early_stops_it() -> None:
    seen: list[tuple[int, str]] = []

    def fetch(key: int) -> int:
        seen.append((key, threading.current_thread().name))
        return key

    it = prefetch(list(range(50)), fetch)
    assert next(it) == 0
    it.close()  # stops fetching and joins the fetch thread
    fetched = [k for k, _ in seen]
    assert fetched == list(range(len(fetched))) and 1 <= len(fetched) <= 4  # in order, bounded lookahead
    assert len({name for _, name in seen}) == 1 and seen[0][1] != threading.current_thread().name


def test_lookahead_is_bounded() -> None:
    """At most ``ahead`` values past the one the caller holds are fetched."""
    fetched: list[int] = []

    def fetch(key: int) -> int:
        fetched.append(key)
        return key

    it = prefetch(list(range(10)), fetch, ahead=2)
    for i in range(10):
        assert next(it) == i
        assert len(fetched) <= i + 3  # the held value, plus 2 fetched ahead (one may be in flight)
    assert fetched == list(range(10))
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(ValueError, match="ahead"):
        list(prefetch([1, 2], fetch, ahead=0))
