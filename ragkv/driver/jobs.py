"""The driver's records: a request (:class:`JobRequest`), its job, the events it posts, the engine it runs on."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ragkv.generation import GenerationConfig
from ragkv.types import CachedText, GenerationStats

if TYPE_CHECKING:
    from ragkv.answering import Prefilled, Riders
    from ragkv.fusion import FusionConfig, PieceBudget

__all__ = ["DecodeCounters", "Event", "Job", "JobRequest", "QueueFullError", "ServedEngine", "queued_post"]

_IDS = itertools.count()


class QueueFullError(Exception):
    """The scheduler holds ``max_queue`` requests already (the server answers 429)."""


class ServedEngine(Protocol):
    """What the driver needs of a tenant's engine (``RagKV`` is one): a prefill in pieces and the model's lock."""

    @property
    def model_lock(self) -> threading.RLock:
        """Held around every forward pass on the shared model."""
        ...

    def prefill_steps(
        self,
        segments: Sequence[str | CachedText] | None = None,
        *,
        rag: tuple[Sequence[str], str] | None = None,
        mode: str = "reuse",
        max_new_tokens: int = 0,
        fusion: FusionConfig | None = None,
        step_tokens: int | PieceBudget | None = None,
        riders: Riders | None = None,
    ) -> Generator[None, None, Prefilled]:
        """The prompt's cache and last logits, in pieces of about ``step_tokens`` tokens of work (each
        ``next()`` runs one); ``riders`` is asked before each piece for a decode step to carry."""
        ...


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What to answer: a prompt, the engine (tenant) it runs on and how to pick its tokens."""

    engine: ServedEngine  # the tenant's RagKV
    generation: GenerationConfig
    mode: str = "reuse"  # "reuse" (load and fuse chunk caches) or "full" (prefill from scratch)
    segments: Sequence[str | CachedText] | None = None  # the whole prompt as segments, or None with ``rag``
    rag: tuple[Sequence[str], str] | None = None  # (chunk texts, question): ragkv's own prompt layout
    fusion: FusionConfig | None = None  # None: the engine's own fusion settings


@dataclass(frozen=True, slots=True)
class Event:
    """What a request's queue receives: ``started`` (prefilled), ``delta`` (text), ``done`` or ``error``."""

    kind: str
    text: str = ""
    stats: GenerationStats | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class Job:
    """One request in the driver: what it asks and where its events go."""

    request: JobRequest
    post: Callable[[Event], None]  # hands an event to the request's consumer (thread-safe for the server)
    id: str = field(default_factory=lambda: f"job-{next(_IDS)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=time.perf_counter)  # when it was asked: TTFT and deadlines count from here

    def cancel(self) -> None:
        """Stop generating for this request (its client left); the scheduler frees the slot next turn."""
        self.cancelled.set()


@dataclass(slots=True)
class DecodeCounters:
    """Where the scheduler's decode time goes (for benchmarks: ms per token outside the forward pass)."""

    steps: int = 0  # batched decode steps taken, carried ones included
    carried_steps: int = 0  # of those, steps that rode on a prefill piece's forward pass
    tokens: int = 0  # tokens those steps produced (one per row per step)
    forward_s: float = 0.0  # inside the batched forward pass (model layers and LM head) of steps of their own
    outside_s: float = 0.0  # the rest of the steps: sampling, detokenizing, stop strings, posting events
    prefill_pieces: int = 0  # prefill pieces run between steps
    prefill_s: float = 0.0  # their time
    decoding_pieces: int = 0  # of those, pieces run while streams were decoding (they waited on them)
    decoding_piece_s: float = 0.0  # their time
    max_decoding_piece_s: float = 0.0  # the longest of them: about the longest gap a stream saw

    def piece(self, seconds: float, *, decoding: bool) -> None:
        """Count a prefill piece that took ``seconds`` (``decoding``: streams waited on it)."""
        self.prefill_s += seconds
        if decoding:
            self.decoding_pieces += 1
            self.decoding_piece_s += seconds
            self.max_decoding_piece_s = max(self.max_decoding_piece_s, seconds)

    def as_dict(self) -> dict[str, float | int]:
        """Totals, and the per-token milliseconds a benchmark prints."""
        per = 1000 / max(1, self.tokens)
        return {
            "steps": self.steps,
            "carried_steps": self.carried_steps,
            "tokens": self.tokens,
            "prefill_pieces": self.prefill_pieces,
            "prefill_s": round(self.prefill_s, 6),
            "decoding_pieces": self.decoding_pieces,
            "decoding_piece_ms": round(1000 * self.decoding_piece_s / max(1, self.decoding_pieces), 3),
            "max_decoding_piece_ms": round(1000 * self.max_decoding_piece_s, 3),
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
