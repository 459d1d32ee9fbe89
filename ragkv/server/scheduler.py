"""The scheduler thread: it owns generation, admitting requests between batched decode steps.

Each loop turn: drop rows whose clients left, prefill at most one waiting request (its fused
prefill, which with reuse is short: the recomputed tokens plus the question), then advance every
active request by one token in one batched forward pass (:class:`ragkv.model.batch.DecodeBatch`).
Results go back to each request's asyncio queue on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragkv.generation import GenerationConfig, pick_token, stream_text
from ragkv.model.batch import DecodeBatch
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
    """

    def __init__(self, adapter: Any, *, max_batch: int = 8, max_queue: int = 32, decode_weights: str = "model") -> None:
        if max_batch < 1 or max_queue < max_batch:
            raise ValueError("need max_batch >= 1 and max_queue >= max_batch")
        self.adapter, self.max_batch, self.max_queue = adapter, max_batch, max_queue
        self._waiting: deque[Job] = deque()
        self._rows: dict[str, _Row] = {}
        self._batch = DecodeBatch(adapter, weights=decode_weights)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._admitting: Job | None = None  # the job taken off the queue this turn
        self.failure: str | None = None  # why the thread died (a bug); None while it runs or never ran
        self.steps = 0  # batched decode steps taken
        self.on_finish: Callable[[Job, GenerationStats | None, str], None] = lambda job, stats, how: None

    # ---- client side ------------------------------------------------------------------------
    @property
    def depth(self) -> tuple[int, int]:
        """(waiting, decoding) requests."""
        with self._cond:
            return len(self._waiting), len(self._rows)

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
            if len(self._waiting) + len(self._rows) >= self.max_queue:
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
            for row in list(self._rows.values()):
                row.job.cancel()
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
        """One loop turn: drop, admit, step. False once stopped with nothing left to finish."""
        with self._cond:
            while not self._waiting and not self._rows and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._rows:
                return False
            job = self._waiting.popleft() if self._waiting and len(self._rows) < self.max_batch else None
            self._admitting = job  # neither waiting nor a row yet: _fail_all must still find it
        self._drop_cancelled()
        if job is not None:
            self._admit(job)
        self._admitting = None
        if self._rows:
            try:
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
            if self._admitting is not None and self._admitting.id not in self._rows:
                jobs.append(self._admitting)
            self._waiting.clear()
            self._rows.clear()
        for job in jobs:
            job.post(Event("error", error=RuntimeError(f"the generation scheduler stopped ({why})")))

    def _drop_cancelled(self) -> None:
        for key, row in list(self._rows.items()):
            if row.job.cancelled.is_set():
                self._finish(key, "cancelled")

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it waited; its last event frees its quota slot
            job.post(Event("error", error=RuntimeError("cancelled before it started")))
            return
        # everything a request brings is set up inside the try: its bad input fails it, not the thread
        try:
            gen = job.generation
            pre = job.engine.prefill(job.segments, rag=job.rag, mode=job.mode, max_new_tokens=gen.max_new_tokens)
            rng = _rng(gen)
            feed = _Feed()
            row = _Row(job, pre.stats, feed, stream_text(self.adapter, iter(feed), gen.stop), rng)
            first = pick_token(pre.logits, gen, rng)
        except Exception as e:  # handed to the request (a 400 for bad input); the server keeps going
            logger.info("prefill of %s failed: %s", job.id, e)
            job.post(Event("error", error=e))
            self.on_finish(job, None, "error")
            return
        with self._cond:
            self._rows[job.id] = row
        job.post(Event("started", stats=pre.stats))
        if self._take(job.id, first):
            try:
                with self._model_lock(job):
                    self._batch.add(job.id, pre.cache, pre.num_tokens)
            except Exception as e:
                logger.exception("adding %s to the decode batch failed", job.id)
                self._finish(job.id, "error", e)

    def _step(self) -> None:
        keys = list(self._batch.keys)
        with self._model_lock(self._rows[keys[0]].job):
            logits = self._batch.step([self._rows[k].last for k in keys])  # [B, vocab]
        self.steps += 1
        for i, key in enumerate(keys):
            row = self._rows[key]
            try:  # one row's bad pick (its own settings) fails that request, not the batch
                token = pick_token(logits[i], row.job.generation, row.rng)
            except Exception as e:
                logger.info("picking a token for %s failed: %s", key, e)
                self._finish(key, "error", e)
                continue
            self._take(key, token)  # a finished row leaves the batch

    @staticmethod
    def _model_lock(job: Job) -> threading.RLock:
        return job.engine.model_lock

    def _take(self, key: str, token: int) -> bool:
        """Hand ``token`` to its request; False when the request is finished (and gone from the rows)."""
        row = self._rows[key]
        if token in self.adapter.eos_token_ids:
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
        if key in self._batch.keys:  # out of the batch first: if re-packing raises, the row stays for _fail_all
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
