"""The answer driver: one loop that prefills requests in pieces between batched decode steps.

Every answer runs through it: the server's requests on its thread (:meth:`Scheduler.start`), the
library's ``RagKV.answer``/``stream`` and the framework integrations in the caller's thread, a
batch of one (:func:`answer_inline`). One place picks tokens, sets TTFT, the load deadline's
verdict and ``finish_reason``, and fills the stats.

Each loop turn: drop rows whose clients left, run one piece of the prefill under way (a new one
starts when none is and a batch row is free: ``RagKV.prefill_steps``, Sarathi-style), then
advance every decoding request by one token in one batched forward pass
(:class:`ragkv.model.batch.DecodeBatch`). A long prompt therefore delays the running streams by
one piece per token, never by its whole prefill.

A piece is sized in time where ``step_ms`` is set (on a CPU, :class:`TimedPieces`): a fused
prefill's layers by the clock, a full prefill's forward pass by the prefill rate measured so
far, so the gap a reader sees between two tokens is about ``step_ms`` plus a step whatever the
model, dtype and machine; with no stream decoding a prefill runs whole (nobody waits on a step).
Otherwise a piece is ``step_tokens`` prompt tokens. Where the piece is a forward pass over prompt
tokens (a full prefill's piece) and the rows decode with the model's own weights on the CPU,
their step rides on that pass (Sarathi-Serve's mixed batch, ``DecodeBatch.carried_step``): the
rows' tokens share the piece's weight reads instead of paying a step of their own. Each
request's events go to its ``post``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ragkv.driver.jobs import DecodeCounters, Event, Job, JobRequest, QueueFullError
from ragkv.fusion import PieceBudget
from ragkv.generation import GenerationConfig, TextStream, pick_token
from ragkv.model.attention import DecodeWeights
from ragkv.model.batch import DecodeBatch, Rider
from ragkv.model.threads import ADAPT_EVERY_STEPS, adapt_threads
from ragkv.planner.throughput import RateEstimate
from ragkv.types import GenerationStats

if TYPE_CHECKING:
    from ragkv.answering import Prefilled
    from ragkv.model import ModelAdapter

logger = logging.getLogger(__name__)

__all__ = ["MIN_PIECE_TOKENS", "Scheduler", "TimedPieces", "answer_inline"]

MIN_PIECE_TOKENS = 32  # a piece sized in time never runs fewer prompt tokens (smaller matmuls waste the CPU)


def _rng(gen: GenerationConfig) -> torch.Generator | None:
    """The request's sampling generator (None when greedy); a seed outside 0..2**64-1 raises ValueError."""
    if gen.temperature == 0:
        return None
    rng = torch.Generator()
    if gen.seed is None:
        rng.seed()
    elif not 0 <= gen.seed < 2**64:
        raise ValueError(f"seed must be in 0..2**64-1, got {gen.seed}")
    else:
        rng.manual_seed(gen.seed)
    return rng


@dataclass(slots=True)
class _Row:
    job: Job
    stats: GenerationStats
    text: TextStream
    rng: torch.Generator | None
    last: int = -1
    count: int = 0  # tokens generated


@dataclass(slots=True)
class _Prefill:
    """The request being prefilled, piece by piece."""

    job: Job
    pieces: Generator[None, None, Prefilled]  # RagKV.prefill_steps; its return value is the Prefilled
    done: int = 0  # pieces run so far


class TimedPieces(PieceBudget):
    """Prefill pieces sized in time: about ``seconds`` of work each while streams decode.

    A fused prefill's layer loops (the question probe, the recompute pass) look at the clock
    between layers (``seconds()``). A full prefill's piece is one forward pass, so it is sized
    ahead: the prefill rate measured on the pieces run so far (an EWMA of tokens per second,
    :class:`~ragkv.planner.throughput.RateEstimate`; the first measurement replaces the guess)
    times ``seconds``, at least :data:`MIN_PIECE_TOKENS`. With no stream decoding (``decoding()``
    false) a piece has no limit: nobody waits on a step.

    >>> b = TimedPieces(0.5, first_rate=200.0, decoding=lambda: True)
    >>> b.tokens(), b.spent(400, 1.0), b.tokens()
    (100, None, 200)
    """

    def __init__(self, seconds: float, *, first_rate: float, decoding: Callable[[], bool]) -> None:
        super().__init__(None)
        if not seconds > 0:
            raise ValueError(f"a piece needs a time > 0 seconds, got {seconds!r}")
        self.piece_s = seconds
        self.rate = RateEstimate(first_rate)  # prompt tokens per second through every layer
        self._decoding = decoding

    def size(self) -> int:
        """A full prefill's piece while streams decode: the measured rate times the piece's time."""
        return max(MIN_PIECE_TOKENS, int(self.rate.rate * self.piece_s))

    def tokens(self) -> int | None:
        return self.size() if self._decoding() else None

    def seconds(self) -> float | None:
        return self.piece_s if self._decoding() else None

    def spent(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self.rate.samples == 0:
            self.rate.seed(tokens / seconds)
        else:
            self.rate.observe(tokens, seconds)


@dataclass(slots=True)
class _Carried(Rider):
    """The rows' decode step offered to a prefill piece, with the request ids of its rows."""

    batch_keys: list[str] = field(default_factory=list)


class Scheduler:
    """Runs requests' generation with batched decode: on its own thread (:meth:`start`), or turn by
    turn in the caller's (:meth:`turn`, as :func:`answer_inline` does).

    Args:
        adapter: the shared model.
        max_batch: requests decoded together at most.
        max_queue: requests held at most (waiting + decoding); more are refused.
        decode_weights: the weights decode steps read (the engine's ``decode_weights``).
        step_tokens: a prefill piece's size in prompt tokens (run between two decode steps), and
            the first guess of a piece sized by ``step_ms``; None: each prefill runs whole.
        step_ms: a prefill piece's time while streams decode (:class:`TimedPieces`), on a CPU
            model; None, or a model on an accelerator (whose kernels run asynchronously, so a
            piece's time is not seen where it is launched): pieces of ``step_tokens``.
        carry: let the rows' decode step ride on a prefill piece's forward pass where it can
            (``DecodeBatch.can_carry``); False: every step runs on its own.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        max_batch: int = 8,
        max_queue: int = 32,
        decode_weights: DecodeWeights = "model",
        step_tokens: int | None = 256,
        step_ms: float | None = None,
        carry: bool = True,
    ) -> None:
        if max_batch < 1 or max_queue < max_batch:
            raise ValueError("need max_batch >= 1 and max_queue >= max_batch")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (or None: whole prefills), got {step_tokens}")
        if step_ms is not None and not step_ms > 0:
            raise ValueError(f"step_ms must be > 0 (or None: pieces of step_tokens), got {step_ms}")
        self.adapter, self.max_batch, self.max_queue = adapter, max_batch, max_queue
        self.step_tokens = step_tokens
        self.pieces: PieceBudget | None = PieceBudget.of(step_tokens)  # what sizes each prefill piece
        if step_ms is not None and step_tokens is not None:
            if adapter.device.type == "cpu":
                self.pieces = TimedPieces(
                    step_ms / 1000, first_rate=step_tokens * 1000 / step_ms, decoding=lambda: bool(self._rows)
                )
            else:
                logger.info("prefill pieces of %d tokens: pieces sized in time are for CPU models", step_tokens)
        self.carry = carry
        self._waiting: deque[Job] = deque()
        self._rows: dict[str, _Row] = {}
        self._batch = DecodeBatch(adapter, weights=decode_weights)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prefill: _Prefill | None = None  # the request being prefilled (neither waiting nor a row)
        self._offer: _Carried | None = None  # the rows' step offered to the prefill piece running now
        self.failure: str | None = None  # why the thread died (a bug); None while it runs or never ran
        self.counters = DecodeCounters()
        self.on_finish: Callable[[Job, GenerationStats | None, str], None] = lambda job, stats, how: None

    # ---- client side ------------------------------------------------------------------------
    @property
    def depth(self) -> tuple[int, int]:
        """(waiting, decoding) requests; one being prefilled counts as decoding."""
        with self._cond:
            return len(self._waiting), len(self._rows) + (self._prefill is not None)

    @property
    def piece_tokens(self) -> int | None:
        """A prefill piece's size now while streams decode, in prompt tokens (None: whole prefills)."""
        if isinstance(self.pieces, TimedPieces):
            return self.pieces.size()
        return self.pieces.tokens() if self.pieces is not None else None

    @property
    def steps(self) -> int:
        """Batched decode steps taken."""
        return self.counters.steps

    @property
    def alive(self) -> bool:
        """False once the thread has died: requests would wait forever, so /health and submit say so."""
        return self.failure is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFullError` past ``max_queue`` and RuntimeError once stopping
        or when the scheduler thread has died."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if not self.alive:
                raise RuntimeError(f"the generation scheduler stopped ({self.failure}); restart the server")
            if len(self._waiting) + len(self._rows) + (self._prefill is not None) >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are queued already")
            self._waiting.append(job)
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ragkv-scheduler", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float = 10.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_s``, cancel the rest."""
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.post(Event("error", error=RuntimeError("the server is shutting down")))
            self._waiting.clear()
            self._cond.notify()
        if self._thread is None:
            return
        self._thread.join(drain_s)
        if self._thread.is_alive():
            pending = self._prefill
            for job in [row.job for row in list(self._rows.values())] + ([pending.job] if pending else []):
                job.cancel()
            self._thread.join(5.0)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self.turn():
                    pass
        except BaseException as e:  # a bug: say so everywhere instead of letting requests hang
            logger.exception("the scheduler thread died")
            self._fail_all(f"{type(e).__name__}: {e}")  # logged; the thread ends here

    def turn(self) -> bool:
        """One loop turn: drop, one prefill piece, step. False once stopped with nothing left to finish.

        Waits while there is nothing to do (the thread's loop); :func:`answer_inline` calls it only
        while its request is unfinished, so it never waits there.
        """
        with self._cond:
            while not self._waiting and not self._rows and self._prefill is None and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._rows and self._prefill is None:
                return False
            job = None
            if self._prefill is None and self._waiting and len(self._rows) < self.max_batch:
                job = self._waiting.popleft()
                # neither waiting nor a row yet: _fail_all must still find it
                self._prefill = _Prefill(job, self._start(job))
        self._drop_cancelled()
        rider = self._advance(self._prefill) if self._prefill is not None else None
        try:
            if rider is not None and rider.logits is not None:  # the piece carried the rows' step
                self._picks(list(rider.batch_keys), rider.logits, time.perf_counter(), carried=True)
            elif len(self._batch):
                self._step()
        except Exception as e:  # one bad step fails the rows decoding now, not the server
            logger.exception("a decode step failed")
            for key in list(self._rows):
                self._finish(key, "error", e)
        return True

    def _fail_all(self, why: str) -> None:
        with self._cond:
            self.failure = why
            jobs = list(self._waiting) + [row.job for row in self._rows.values()]
            if self._prefill is not None and self._prefill.job.id not in self._rows:
                jobs.append(self._prefill.job)
            self._waiting.clear()
            self._rows.clear()
            self._prefill = None
        for job in jobs:
            job.post(Event("error", error=RuntimeError(f"the generation scheduler stopped ({why})")))

    def _drop_cancelled(self) -> None:
        for key, row in list(self._rows.items()):
            if row.job.cancelled.is_set():
                self._finish(key, "cancelled")
        pending = self._prefill
        if pending is not None and pending.job.cancelled.is_set():  # its client left: its last event frees its slot
            pending.pieces.close()
            self._end_prefill()
            when = "while its prompt was prefilled" if pending.done else "before it started"
            pending.job.post(Event("error", error=RuntimeError(f"cancelled {when}")))

    def _start(self, job: Job) -> Generator[None, None, Prefilled]:
        """``job``'s prefill, in pieces (no work done yet: arguments are checked at the first piece)."""
        req = job.request
        return req.engine.prefill_steps(
            req.segments,
            rag=req.rag,
            mode=req.mode,
            max_new_tokens=req.generation.max_new_tokens,
            fusion=req.fusion,
            step_tokens=self.pieces,
            riders=self._offered,
        )

    def _offered(self) -> Rider | None:
        """The decode step offered to the prefill piece running now (what ``prefill_steps`` asks before each)."""
        return self._offer

    def _end_prefill(self) -> None:
        with self._cond:
            self._prefill = None

    def _advance(self, pending: _Prefill) -> _Carried | None:
        """Run one piece of ``pending``'s prefill; after its last, it becomes a decoding row.

        Returns the decode step offered to the piece (its ``logits`` set when the piece carried it).
        """
        job = pending.job
        rider = self._rider()
        # everything a request brings is set up inside the try: its bad input fails it, not the thread
        try:
            pending.done += 1
            self.counters.prefill_pieces += 1
            self._offer = rider
            began = time.perf_counter()
            try:
                next(pending.pieces)
                return rider  # more pieces to come, one per turn
            except StopIteration as finished:
                pre: Prefilled = finished.value
            finally:
                self._offer = None
                self.counters.piece(time.perf_counter() - began, decoding=bool(self._rows))
            gen = job.request.generation
            rng = _rng(gen)
            row = _Row(job, pre.stats, TextStream(self.adapter, gen.stop), rng)
            first = pick_token(pre.logits, gen, rng)
        except Exception as e:  # handed to the request (a 400 for bad input); the server keeps going
            logger.info("prefill of %s failed: %s", job.id, e)
            self._end_prefill()
            job.post(Event("error", error=e))
            self.on_finish(job, None, "error")
            return rider  # a step it carried before failing still counts for the rows
        with self._cond:
            self._rows[job.id] = row
            self._prefill = None
        job.post(Event("started", stats=pre.stats))
        if self._take(job.id, first):
            try:
                with self._model_lock(job):
                    self._batch.add(job.id, pre.cache, pre.num_tokens, reserve=gen.max_new_tokens)
            except Exception as e:
                logger.exception("adding %s to the decode batch failed", job.id)
                self._finish(job.id, "error", e)
        return rider

    def _rider(self) -> _Carried | None:
        """The rows' next decode step, offered to the coming prefill piece (None: it cannot ride)."""
        if not self.carry or not self._batch.can_carry():
            return None
        keys = list(self._batch.keys)
        return _Carried(self._batch, [self._rows[k].last for k in keys], batch_keys=keys)

    def _step(self) -> None:
        keys = list(self._batch.keys)
        if (self.counters.steps - self.counters.carried_steps) % ADAPT_EVERY_STEPS == 0:
            adapt_threads()  # another process may have taken a core (RAGKV_THREADS; ragkv.model.threads)
        started = time.perf_counter()
        with self._model_lock(self._rows[keys[0]].job):
            logits = self._batch.step([self._rows[k].last for k in keys])  # [B, vocab]
        forwarded = time.perf_counter()
        self.counters.forward_s += forwarded - started
        self._picks(keys, logits, forwarded, carried=False)

    def _picks(self, keys: list[str], logits: torch.Tensor, forwarded: float, *, carried: bool) -> None:
        """Pick and hand on each row's token from one step's ``logits`` ``[B, vocab]`` (rows in ``keys`` order)."""
        c = self.counters
        c.steps, c.tokens, c.carried_steps = c.steps + 1, c.tokens + len(keys), c.carried_steps + carried
        for i, key in enumerate(keys):
            row = self._rows[key]
            try:  # one row's bad pick (its own settings) fails that request, not the batch
                token = pick_token(logits[i], row.job.request.generation, row.rng)
            except Exception as e:
                logger.info("picking a token for %s failed: %s", key, e)
                self._finish(key, "error", e)
                continue
            self._take(key, token)  # a finished row leaves the batch
        c.outside_s += time.perf_counter() - forwarded

    @staticmethod
    def _model_lock(job: Job) -> threading.RLock:
        return job.request.engine.model_lock

    def _take(self, key: str, token: int) -> bool:
        """Hand ``token`` to its request; False when the request is finished (and gone from the rows).

        The one place an answer's first token is timed (TTFT: from the job's ``t0``, when it was
        asked) and the load deadline judged (met when the first token came within it).
        """
        row = self._rows[key]
        gen = row.job.request.generation
        if token in self.adapter.eos_token_ids and not gen.ignore_eos:
            self._finish(key, "stop")
            return False
        if row.count == 0:
            _first_token(row.stats, row.job.t0)
        row.count += 1
        row.last = token
        delta = row.text.push(token)
        if delta:
            row.job.post(Event("delta", text=delta))
        if row.text.stopped:  # a stop string ended the text
            self._finish(key, "stop")
            return False
        if row.count >= gen.max_new_tokens:
            self._finish(key, "length")
            return False
        return True

    def _finish(self, key: str, how: str, error: BaseException | None = None) -> None:
        """End a request: flush its held-back text, post ``done`` (or ``error``), drop its row (and batch row).

        The one place an answer's ``finish_reason`` (``how``: stop, length, cancelled) and its
        ``total_ms`` are set.
        """
        with self._cond:
            row = self._rows[key]
        if key in self._batch.keys:  # out of the batch first: if that raises, the row stays for _fail_all
            self._batch.remove(key)
        with self._cond:
            self._rows.pop(key, None)
        if error is not None:
            row.job.post(Event("error", error=error))
            self.on_finish(row.job, None, "error")
            return
        rest = row.text.flush() if how != "cancelled" else ""
        if rest:
            row.job.post(Event("delta", text=rest))
        stats = row.stats
        stats.generated_tokens = row.count
        stats.total_ms = (time.perf_counter() - row.job.t0) * 1000
        if row.count == 0:
            _first_token(stats, row.job.t0)
        stats.extra["finish_reason"] = how
        row.job.post(Event("done", stats=stats))
        self.on_finish(row.job, stats, how)


def _first_token(stats: GenerationStats, t0: float) -> None:
    """Set TTFT (now, from ``t0``) and whether the load deadline was met (the first token came within it)."""
    stats.ttft_ms = (time.perf_counter() - t0) * 1000
    load = stats.extra.get("load")
    if isinstance(load, dict) and load.get("deadline_ms") is not None:
        load["deadline_met"] = stats.ttft_ms <= load["deadline_ms"]


def answer_inline(request: JobRequest, adapter: ModelAdapter, decode_weights: DecodeWeights) -> Iterator[Event]:
    """``request`` answered through the driver in the calling thread: a scheduler of one row, turned here.

    Yields its ``delta`` events, then ``done`` (the stats); an ``error`` event is raised (a bad
    prompt's ValueError, say). What the library's ``RagKV.answer``/``stream`` and the framework
    integrations run: concurrent callers share the model through the engine's model lock, taken
    for each prefill piece and each step, so their answers interleave token by token. A caller
    that stops reading ends the answer (its row is cancelled).
    """
    events: deque[Event] = deque()
    scheduler = Scheduler(adapter, max_batch=1, max_queue=1, decode_weights=decode_weights, step_tokens=None)
    job = Job(request, post=events.append)
    scheduler.submit(job)
    try:
        while True:
            while events:
                event = events.popleft()
                if event.kind == "error" and event.error is not None:
                    raise event.error
                if event.kind in ("delta", "done"):
                    yield event
                if event.kind == "done":
                    return
            if not scheduler.depth[1] and not scheduler.depth[0]:  # pragma: no cover - a bug, not a request's fault
                raise RuntimeError(f"the driver dropped {job.id} without a last event")
            with torch.inference_mode():
                scheduler.turn()
    finally:
        job.cancel()
        if scheduler.depth != (0, 0):  # the caller stopped reading: the next turn drops the row, computing nothing
            with torch.inference_mode():
                scheduler.turn()
