"""OrderedDecodes: results in submission order, a bounded number in flight, errors where taken back."""

from __future__ import annotations

import threading
import time

import pytest

from ragkv.retriever.decoding import OrderedDecodes, decode_all


def test_results_come_back_in_order_whatever_order_they_finish_in() -> None:
    def call(i: int):
        def run() -> int:
            time.sleep(0.02 * (5 - i))  # the first finishes last
            return i * i

        return run

    assert decode_all([call(i) for i in range(6)], workers=4) == [i * i for i in range(6)]
    assert decode_all([call(i) for i in range(6)], workers=1) == [i * i for i in range(6)]


def test_one_worker_runs_inline_and_hands_each_result_back_at_once() -> None:
    decodes: OrderedDecodes[str, str] = OrderedDecodes(1)
    names = []
    for tag in "abc":
        got = decodes.submit(tag, lambda: threading.current_thread().name)
        names.extend(n for _, n in got)
        assert [t for t, _ in got] == [tag]
    assert decodes.finish() == []
    assert set(names) == {threading.current_thread().name}


def test_calls_in_flight_are_bounded_by_twice_the_workers() -> None:
    running = 0
    most = 0
    lock = threading.Lock()
    release = threading.Event()

    def run() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(timeout=30)
        with lock:
            running -= 1
        return 1

    decodes: OrderedDecodes[int, int] = OrderedDecodes(2)
    taken = []
    for i in range(4):  # up to 4 pending: none taken back yet
        taken.extend(decodes.submit(i, run))
    assert taken == []
    release.set()
    taken.extend(decodes.submit(4, run))  # the fifth: the oldest is taken back
    assert [t for t, _ in taken] == [0]
    assert [t for t, _ in decodes.finish()] == [1, 2, 3, 4]
    assert most <= 2


def test_an_error_is_raised_where_its_result_is_taken_back() -> None:
    def fail() -> int:
        raise ValueError("damaged")

    for workers in (1, 3):
        decodes: OrderedDecodes[int, int] = OrderedDecodes(workers)
        assert decodes.submit(0, lambda: 7) == ([(0, 7)] if workers == 1 else [])
        with pytest.raises(ValueError, match="damaged"):  # inline: at once; on threads: when taken back
            decodes.submit(1, fail)
            decodes.finish()
        decodes.cancel()


def test_cancel_drops_what_has_not_started() -> None:
    gate = threading.Event()
    ran = []
    decodes: OrderedDecodes[int, None] = OrderedDecodes(2)
    decodes.submit(0, lambda: gate.wait(timeout=30) and None)
    decodes.submit(1, lambda: gate.wait(timeout=30) and None)
    for i in range(2, 4):
        decodes.submit(i, lambda i=i: ran.append(i))
    decodes.cancel()
    gate.set()
    time.sleep(0.1)
    assert decodes.finish() == []
    assert len(ran) <= 2  # at most the ones a thread had picked up before the cancel


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        OrderedDecodes(0)
