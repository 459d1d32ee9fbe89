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


def test_cancel_drops_what_has_not_started_and_waits_for_what_runs() -> None:
    gate = threading.Event()
    started = threading.Barrier(3, timeout=30)
    ran: list[int] = []
    finished: list[int] = []

    def blocking(i: int):
        def run() -> None:
            started.wait()
            gate.wait(timeout=30)
            finished.append(i)

        return run

    decodes: OrderedDecodes[int, None] = OrderedDecodes(2)  # a pool of exactly 2 threads
    decodes.submit(0, blocking(0))
    decodes.submit(1, blocking(1))
    started.wait()  # both threads are busy: the next calls wait in the queue
    for i in range(2, 4):
        decodes.submit(i, lambda i=i: ran.append(i))
    threading.Timer(0.2, gate.set).start()
    decodes.cancel()
    assert sorted(finished) == [0, 1]  # cancel returned only once the running calls were done
    time.sleep(0.1)
    assert ran == [] and decodes.finish() == []


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        OrderedDecodes(0)


def test_calls_on_worker_threads_run_inside_around_and_inline_ones_do_not_need_it() -> None:
    # the loader passes the request's CUDA stream this way; a marker stands in for it here
    inside = threading.local()

    class Around:
        def __enter__(self) -> None:
            inside.marked = True

        def __exit__(self, *exc: object) -> None:
            inside.marked = False

    def seen() -> bool:
        return getattr(inside, "marked", False)

    many: OrderedDecodes[int, bool] = OrderedDecodes(3, around=Around)
    results = [r for i in range(6) for _, r in many.submit(i, seen)] + [r for _, r in many.finish()]
    assert results == [True] * 6
    one: OrderedDecodes[int, bool] = OrderedDecodes(1, around=Around)
    assert [r for _, r in one.submit(0, seen)] == [False]  # inline: already on the caller's stream
