"""The scheduler thread: it owns generation, prefilling requests in pieces between batched decode steps.

Each loop turn: drop rows whose clients left, run one piece of the prefill under way (a new one
starts when none is and a batch row is free: ``RagKV.prefill_steps``, about ``step_tokens``
tokens of work a piece, Sarathi-style), then advance every decoding request by one token in one
batched forward pass (:class:`ragkv.model.batch.DecodeBatch`). A long prompt therefore delays
the running streams by one piece per token, never by its whole prefill. Where the piece is a
forward pass over prompt tokens (a full prefill's piece) and the rows decode with the model's
own weights on the CPU, their step rides on that pass (Sarathi-Serve's mixed batch,
``DecodeBatch.carried_step``): the rows' tokens share the piece's weight reads instead of paying
a step of their own. Results go back to each request's asyncio queue on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragkv.generation import GenerationConfig, pick_token, stream_text
from ragkv.model.attention import DecodeWeights
from ragkv.model.batch import DecodeBatch, Rider
from ragkv.model.threads import ADAPT_EVERY_STEPS, adapt_threads
from ragkv.types import CachedText, GenerationStats

if TYPE_CHECKING:
    from ragkv.engine import Prefilled

logger = logging.getLogger(__name__)

__all__ = ["Event", "Job", "QueueFullError", "Scheduler", "ServedEngine"]

_IDS = itertools.count()


class QueueFullError(Exception):
    """The scheduler holds ``max_queue`` requests already (the server answers 429)."""


class ServedEngine(Protocol):
    """What the scheduler needs of a tenant's engine (``RagKV`` is one): a prefill and the model's lock."""

    @property
    def model_lock(self) -> threading.RLock:
        """Held around every forward pass on the shared model."""
        ...

    def prefill(
        self,
        segments: Sequence[str | CachedText] | None = None,
        *,
        rag: tuple[Sequence[str], str] | None = None,
        mode: str = "reuse",
        max_new_tokens: int = 0,
    ) -> Prefilled:
        """The prompt's cache and last logits, ready for decoding."""
        ...

    def prefill_steps(
        self,
        segments: Sequence[str | CachedText] | None = None,
        *,
        rag: tuple[Sequence[str], str] | None = None,
        mode: str = "reuse",
        max_new_tokens: int = 0,
        step_tokens: int | None = None,
        riders: Callable[[], Rider | None] | None = None,
    ) -> Generator[None, None, Prefilled]:
        """:meth:`prefill` in pieces of about ``step_tokens`` tokens of work (each ``next()`` runs one)."""
        ...


@dataclass(frozen=True, slots=True)
class Event:
    """What a request's queue receives: ``started`` (prefilled), ``delta`` (text), ``done`` or ``error``."""

    kind: str
    text: str = ""
    stats: GenerationStats | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class Job:
    """One request: its prompt, its engine (tenant) and where its events go."""

    engine: ServedEngine  # the tenant's RagKV
    segments: Sequence[str | CachedText] | None  # the whole prompt as segments, or None with ``rag``
    rag: tuple[Sequence[str], str] | None  # (chunk texts, question): ragkv's own prompt layout
    mode: str  # "reuse" or "full"
    generation: GenerationConfig
    post: Callable[[Event], None]  # hands an event to the request's consumer (thread-safe)
    id: str = field(default_factory=lambda: f"job-{next(_IDS)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop generating for this request (its client left); the scheduler frees the slot next turn."""
        self.cancelled.set()


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


class _Feed:
    """The token iterator a request's ``stream_text`` pulls from: the scheduler sets one token per pull."""

    def __init__(self) -> None:
        self.token = -1
        self.done = False

    def __iter__(self) -> Iterator[int]:
        while not self.done:
            yield self.token


@dataclass(slots=True)
class _Row:
    job: Job
    stats: GenerationStats
    feed: _Feed
    text: Iterator[tuple[str, int]]  # stream_text over ``feed``
    rng: torch.Generator | None
    last: int = -1
    count: int = 0  # tokens generated


@dataclass(slots=True)
class _Prefill:
    """The request being prefilled, piece by piece."""

    job: Job
    pieces: Generator[None, None, Prefilled]  # RagKV.prefill_steps; its return value is the Prefilled
    done: int = 0  # pieces run so far


@dataclass(slots=True)
class _Carried(Rider):
    """The rows' decode step offered to a prefill piece, with the request ids of its rows."""

    batch_keys: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DecodeCounters:
    """Where the scheduler's decode time goes (for benchmarks: ms per token outside the forward pass)."""

    steps: int = 0  # batched decode steps taken, carried ones included
    carried_steps: int = 0  # of those, steps that rode on a prefill piece's forward pass
    tokens: int = 0  # tokens those steps produced (one per row per step)
    forward_s: float = 0.0  # inside the batched forward pass (model layers and LM head) of steps of their own
    outside_s: float = 0.0  # the rest of the steps: sampling, detokenizing, stop strings, posting events
    prefill_pieces: int = 0  # prefill pieces run between steps

    def as_dict(self) -> dict[str, float | int]:
        """Totals, and the per-token milliseconds a benchmark prints."""
        per = 1000 / max(1, self.tokens)
        return {
            "steps": self.steps,
            "carried_steps": self.carried_steps,
            "tokens": self.tokens,
            "prefill_pieces": self.prefill_pieces,
            "forward_s": round(self.forward_s, 6),
            "outside_s": round(self.outside_s, 6),
            "forward_ms_per_step": round(1000 * self.forward_s / max(1, self.steps - self.carried_steps), 3),
            "outside_ms_per_token": round(self.outside_s * per, 3),
        }


def queued_post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event]) -> Callable[[Event], None]:
    """A ``post`` that puts events on ``queue`` from any thread (dropped once the loop is closed)."""

    def post(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, event)

    return post


class Scheduler:
    """Runs every request's generation on one thread with batched decode.

    Args:
        adapter: the shared model.
        max_batch: requests decoded together at most.
        max_queue: requests held at most (waiting + decoding); more are refused.
        decode_weights: the weights decode steps read (the engine's ``decoder.weights``).
        step_tokens: a prefill piece's size in prompt tokens (run between two decode steps);
            None: each prefill runs whole between two steps.
        carry: let the rows' decode step ride on a prefill piece's forward pass where it can
            (``DecodeBatch.can_carry``); False: every step runs on its own.
    """

    def __init__(
        self,
        adapter: Any,
        *,
        max_batch: int = 8,
        max_queue: int = 32,
        decode_weights: DecodeWeights = "model",
        step_tokens: int | None = 256,
        carry: bool = True,
    ) -> None:
        if max_batch < 1 or max_queue < max_batch:
            raise ValueError("need max_batch >= 1 and max_queue >= max_batch")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (or None: whole prefills), got {step_tokens}")
        self.adapter, self.max_batch, self.max_queue = adapter, max_batch, max_queue
        self.step_tokens = step_tokens
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
                while self._turn():
                    pass
        except BaseException as e:  # a bug: say so everywhere instead of letting requests hang
            logger.exception("the scheduler thread died")
            self._fail_all(f"{type(e).__name__}: {e}")  # logged; the thread ends here

    def _turn(self) -> bool:
        """One loop turn: drop, one prefill piece, step. False once stopped with nothing left to finish."""
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
        n = job.generation.max_new_tokens
        return job.engine.prefill_steps(
            job.segments,
            rag=job.rag,
            mode=job.mode,
            max_new_tokens=n,
            step_tokens=self.step_tokens,
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
            try:
                next(pending.pieces)
                return rider  # more pieces to come, one per turn
            except StopIteration as finished:
                pre: Prefilled = finished.value
            finally:
                self._offer = None
            gen = job.generation
            rng = _rng(gen)
            feed = _Feed()
            row = _Row(job, pre.stats, feed, stream_text(self.adapter, iter(feed), gen.stop), rng)
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
                    self._batch.add(job.id, pre.cache, pre.num_tokens, reserve=job.generation.max_new_tokens)
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
                token = pick_token(logits[i], row.job.generation, row.rng)
            except Exception as e:
                logger.info("picking a token for %s failed: %s", key, e)
                self._finish(key, "error", e)
                continue
            self._take(key, token)  # a finished row leaves the batch
        c.outside_s += time.perf_counter() - forwarded

    @staticmethod
    def _model_lock(job: Job) -> threading.RLock:
        return job.engine.model_lock

    def _take(self, key: str, token: int) -> bool:
        """Hand ``token`` to its request; False when the request is finished (and gone from the rows)."""
        row = self._rows[key]
        if token in self.adapter.eos_token_ids and not row.job.generation.ignore_eos:
            self._finish(key, "stop")
            return False
        if row.count == 0:
            row.stats.ttft_ms = (time.perf_counter() - row.job.t0) * 1000
        row.count += 1
        row.last = token
        row.feed.token = token
        delta = next(row.text, None)
        if delta is None:  # a stop string ended the text
            self._finish(key, "stop")
            return False
        if delta[0]:
            row.job.post(Event("delta", text=delta[0]))
        if row.count >= row.job.generation.max_new_tokens:
            self._finish(key, "length")
            return False
        return True

    def _finish(self, key: str, how: str, error: BaseException | None = None) -> None:
        """End a request: flush its held-back text, post ``done`` (or ``error``), drop its row (and batch row)."""
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
        if how != "cancelled":
            row.feed.done = True
            for delta, _ in row.text:
                if delta:
                    row.job.post(Event("delta", text=delta))
        row.stats.generated_tokens = row.count
        row.stats.total_ms = (time.perf_counter() - row.job.t0) * 1000
        if row.count == 0:
            row.stats.ttft_ms = row.stats.total_ms
        row.stats.extra["finish_reason"] = how
        row.job.post(Event("done", stats=row.stats))
        self.on_finish(row.job, row.stats, how)
