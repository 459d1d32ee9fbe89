"""Stall-free batching: a long prompt's prefill runs in pieces between decode steps of the running rows.

Events are counted, never timed: between two pieces of a long prefill the scheduler takes exactly one
decode step, and the running stream, decoding from before the first piece to after the last, gets a
token at each of them. (Its text events are not counted one per token: random weights emit byte
tokens whose text the stream holds back until it decodes.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ragkv.driver import Event, Job, JobRequest, Scheduler, TimedPieces
from ragkv.driver.scheduler import MIN_PIECE_TOKENS
from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.embedder import HashingEmbedder

LONG = ["Background notes follow. " + "The orchard keeps many apple trees in rows. " * 30 + "Question: why?"]


class _Log:
    """One ordered record of every request's events and every prefill piece (posted on the scheduler thread)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []  # (who, what, scheduler steps at that moment)
        self.finished: dict[str, threading.Event] = {}
        self.last: dict[str, Event] = {}
        self.scheduler: Scheduler | None = None

    def post(self, who: str):
        self.finished[who] = threading.Event()

        def post(event: Event) -> None:
            self.entries.append((who, event.kind, self.scheduler.steps if self.scheduler else 0))
            if event.kind in ("done", "error"):
                self.last[who] = event
                self.finished[who].set()

        return post


class _Counted:
    """A tenant engine whose prefill pieces are logged (the real engine does the work)."""

    def __init__(self, engine: RagKV, log: _Log, who: str) -> None:
        self.engine, self.log, self.who = engine, log, who

    @property
    def model_lock(self) -> threading.RLock:
        return self.engine.model_lock

    def prefill_steps(self, *args, **kw):
        pieces = self.engine.prefill_steps(*args, **kw)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            self.log.entries.append((self.who, "piece", self.log.scheduler.steps))
            yield


@pytest.fixture
def engine(tmp_path: Path, llama_adapter):
    cfg = EngineConfig(data_dir=tmp_path, store=("memory://", str(tmp_path / "kv")))
    with RagKV(cfg, adapter=llama_adapter, embedder=HashingEmbedder(dim=64)) as rag:
        yield rag


def _job(engine, log: _Log, who: str, segments: list[str], tokens: int) -> Job:
    gen = GenerationConfig(max_new_tokens=tokens)
    return Job(JobRequest(_Counted(engine, log, who), gen, "full", segments=segments), log.post(who))


def _long_while_short_streams(engine, log: _Log, scheduler: Scheduler) -> int:
    """Start ``scheduler``, stream a short request, submit LONG once it decodes; wait for both, stop.
    Returns LONG's prompt tokens."""
    scheduler.start()
    try:
        scheduler.submit(_job(engine, log, "short", ["Hello there, tell me a story"], tokens=400))
        while not any(who == "short" and what == "delta" for who, what, _ in log.entries):
            assert not log.finished["short"].wait(0.01), "the short request ended before the long one came"
        long_ids = len(engine.adapter.encode(LONG[0]))
        scheduler.submit(_job(engine, log, "long", LONG, tokens=4))
        assert log.finished["long"].wait(120) and log.finished["short"].wait(120)
    finally:
        scheduler.stop()
    return long_ids


def test_a_running_stream_gets_tokens_between_the_pieces_of_a_long_prefill(engine):
    log = _Log()
    # steps of their own (carried steps would shrink the pieces by the rows riding: the next test)
    scheduler = log.scheduler = Scheduler(engine.adapter, max_batch=4, step_tokens=16, carry=False)
    long_ids = _long_while_short_streams(engine, log, scheduler)
    pieces = [steps for who, what, steps in log.entries if who == "long" and what == "piece"]
    assert len(pieces) == -(-long_ids // 16) - 1  # every piece but the last pauses
    # exactly one batched decode step between two pieces: the running stream never waits for the whole prefill
    assert [b - a for a, b in zip(pieces, pieces[1:], strict=False)] == [1] * (len(pieces) - 1)
    short = [(what, steps) for who, what, steps in log.entries if who == "short" and what != "piece"]
    assert short[0][0] == "started" and short[1][0] == "delta" and short[1][1] < pieces[0]  # decoding before
    assert short[-1] == ("done", short[-1][1]) and short[-1][1] > pieces[-1]  # and after: a token every step
    stats = log.last["short"].stats
    assert stats is not None and stats.generated_tokens == 400 and stats.extra["finish_reason"] == "length"
    kinds = [what for who, what, _ in log.entries if who == "long"]
    assert kinds[-1] == "done" and "started" in kinds
    assert log.last["long"].stats.extra["prefill_pieces"] == len(pieces) + 1


def test_a_request_cancelled_during_its_prefill_ends_and_the_stream_goes_on(engine):
    log = _Log()
    scheduler = log.scheduler = Scheduler(engine.adapter, max_batch=4, step_tokens=8)
    scheduler.start()
    try:
        scheduler.submit(_job(engine, log, "short", ["Hello there, tell me a story"], tokens=200))
        long = _job(engine, log, "long", LONG, tokens=4)
        scheduler.submit(long)
        while not any(e[:2] == ("long", "piece") for e in log.entries):
            assert not log.finished["long"].wait(0.01)
        long.cancel()
        assert log.finished["long"].wait(60)
        assert log.finished["short"].wait(120)
    finally:
        scheduler.stop()
    long_events = [what for who, what, _ in log.entries if who == "long" and what != "piece"]
    assert long_events == ["error"]
    assert [what for who, what, _ in log.entries if who == "short"][-1] == "done"
    assert scheduler.alive and scheduler.depth == (0, 0)


def _answers(engine, carry: bool) -> tuple[dict[str, str], Scheduler]:
    """Both requests queued before the scheduler starts (a fixed order of turns); their texts."""
    log = _Log()
    scheduler = log.scheduler = Scheduler(engine.adapter, max_batch=4, step_tokens=16, carry=carry)
    texts = {"short": "", "long": ""}
    for who, segments, tokens in (("short", ["Hello there, tell me a story"], 60), ("long", LONG, 6)):
        post = log.post(who)

        def collect(event: Event, who=who, post=post) -> None:
            if event.kind == "delta":
                texts[who] += event.text
            post(event)

        gen = GenerationConfig(max_new_tokens=tokens)
        scheduler.submit(Job(JobRequest(_Counted(engine, log, who), gen, "full", segments=segments), collect))
    scheduler.start()
    try:
        assert log.finished["long"].wait(120) and log.finished["short"].wait(120)
    finally:
        scheduler.stop()
    assert log.last["short"].kind == log.last["long"].kind == "done"
    return texts, scheduler


def test_decode_steps_carried_on_prefill_pieces_give_the_same_answers(engine):
    """The slow path: every step on its own. Carried on the long prompt's pieces, the texts are the same."""
    alone, plain = _answers(engine, carry=False)
    carried, mixed = _answers(engine, carry=True)
    assert carried == alone and all(carried.values())
    assert plain.counters.carried_steps == 0
    # the short stream takes 59 steps (its first token comes from its prefill); all but the one in the turn of
    # its own prefill's last piece rode on the long prompt's pieces (there are more of them than 60)
    assert mixed.counters.prefill_pieces > 60 and mixed.counters.carried_steps == 59 - 1
    assert mixed.counters.steps == plain.counters.steps and mixed.counters.tokens == plain.counters.tokens
    # a piece's budget counts its rider: 15 prompt tokens + 1 row while the short stream decodes, 16 after
    short_ids, long_ids = (len(engine.adapter.encode(t)) for t in ("Hello there, tell me a story", LONG[0]))
    short_pieces = -(-short_ids // 16)  # no rows yet: whole budgets
    assert mixed.counters.prefill_pieces == short_pieces + 58 + -(-(long_ids - 15 * 58) // 16)


def test_pieces_sized_in_time_run_whole_with_no_stream_and_by_the_measured_rate_with_one(engine):
    """``step_ms``: the short prompt, prefilled while nothing decodes, runs in one piece; the long one, while
    the short stream decodes, in pieces of the rate times the piece's time (the rate held fixed here so the
    sizes are known: what is measured is TimedPieces' own test)."""
    log = _Log()
    scheduler = log.scheduler = Scheduler(engine.adapter, max_batch=4, step_tokens=16, step_ms=1000, carry=False)
    assert isinstance(scheduler.pieces, TimedPieces) and scheduler.piece_tokens == MIN_PIECE_TOKENS  # 16/s: the floor
    scheduler.pieces.rate.seed(48.0)  # tokens per second: 48-token pieces of a second each
    scheduler.pieces.spent = lambda tokens, seconds: None  # type: ignore[method-assign]
    long_ids = _long_while_short_streams(engine, log, scheduler)
    assert not [e for e in log.entries if e[:2] == ("short", "piece")]  # one piece: no pause
    pieces = [steps for who, what, steps in log.entries if who == "long" and what == "piece"]
    assert len(pieces) == -(-long_ids // 48) - 1 and scheduler.piece_tokens == 48
    assert [b - a for a, b in zip(pieces, pieces[1:], strict=False)] == [1] * (len(pieces) - 1)
    c = scheduler.counters.as_dict()
    assert c["decoding_pieces"] == len(pieces) + 1 and c["prefill_pieces"] == len(pieces) + 2


def test_timed_pieces_learn_the_rate_from_what_each_piece_reports():
    decoding = [True]
    b = TimedPieces(0.25, first_rate=1000.0, decoding=lambda: decoding[0])
    assert b.tokens() == 250
    b.spent(100, 1.0)  # the first measurement replaces the guess
    assert b.rate.rate == pytest.approx(100.0) and b.tokens() == MIN_PIECE_TOKENS  # 25 tokens: the floor
    b.spent(400, 1.0)  # then a moving average of seconds per token (0.3 of the way)
    assert b.rate.rate == pytest.approx(1 / (0.01 + 0.3 * (0.0025 - 0.01)))
    b.spent(0, 1.0), b.spent(10, 0.0)  # nothing measured: ignored
    assert b.rate.samples == 2
    decoding[0] = False
    assert b.tokens() is None  # nobody waits on a step: no limit
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="time > 0"):
            TimedPieces(bad, first_rate=1.0, decoding=lambda: True)


def test_step_ms_is_refused_unless_positive(engine):
    with pytest.raises(ValueError, match="step_ms must be > 0"):
        Scheduler(engine.adapter, step_ms=0)
