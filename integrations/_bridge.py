"""What the framework adapters share: the engine's chunk registry, a per-engine lock, prompt rendering, generation.

Every adapter ends in :func:`stream`: a finished prompt string (chat special tokens included) is
cut into segments around the chunk texts registered for that engine, and the engine generates
from the segments. A prompt with no registered chunk is one plain segment, which the engine
prefills like the model alone.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ragkv.matching import ChunkRegistry

if TYPE_CHECKING:
    from ragkv.engine import RagKV
    from ragkv.generation import GenerationConfig
    from ragkv.types import GenerationStats

__all__ = [
    "EngineState",
    "aiterate",
    "collect",
    "STATS_KEY",
    "default_engine",
    "engine_state",
    "stream",
    "summarize",
    "registry",
    "warm",
]

# Phrases of the context templates of LlamaIndex and LangChain (and common hand-written ones): a
# prompt holding one of them was meant to carry retrieved text, so finding no chunk is worth a word.
_CONTEXT_MARKERS = (
    "context information",
    "---------------------",
    "context:",
    "<context>",
    "use the following pieces of",
    "retrieved context",
)

T = TypeVar("T")
logger = logging.getLogger(__name__)

STATS_KEY = "ragkv"  # the key stats live under in every framework's metadata dict

_SUMMED = (
    "prompt_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "prefilled_chunk_tokens",
    "bytes_loaded",
    "generated_tokens",
    "cache_hits",
    "cache_misses",
    "chunks_in_prompt",
)


@dataclass(slots=True)
class EngineState:
    """What the adapters keep per engine object."""

    # Generation and warming are serialized per engine: the engine's store, catalog and model are
    # not documented as safe under concurrent calls, and LangChain's batch runs calls in threads.
    # A plain Lock (not RLock) because an abandoned stream may be closed from another thread.
    lock: threading.Lock = field(default_factory=threading.Lock)
    warned: set[str] = field(default_factory=set)  # no-reuse reasons already logged


_STATES: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()
_DEFAULT: list[RagKV] = []


def engine_state(engine: RagKV) -> EngineState:
    """The registry and lock of ``engine`` (created on first use, dropped with the engine)."""
    with _STATES_LOCK:
        state = _STATES.get(engine)
        if state is None:
            state = _STATES[engine] = EngineState()
        return state


def default_engine() -> RagKV:
    """A process-wide engine with every default, then ``RAGKV_*`` variables (model dtype/device too), built once."""
    with _STATES_LOCK:
        if not _DEFAULT:
            from ragkv.engine import EngineConfig, RagKV

            _DEFAULT.append(RagKV(EngineConfig.from_env()))
        return _DEFAULT[0]


def stream(
    engine: RagKV, prompt: str, generation: GenerationConfig, *, reuse_chunks: bool = True
) -> Iterator[tuple[str, GenerationStats | None]]:
    """Generate from ``prompt``, reusing the caches of the registered chunks it contains.

    Yields ``(delta, None)`` per piece of answer text, then ``("", stats)``; ``stats.extra``
    gains ``chunks_in_prompt`` (how many segments were cached chunks) and, when a prompt that looks
    like retrieved context reuses no chunk, ``reuse_warning`` (the reason). ``reuse_chunks=False``
    prefills the whole prompt like the plain model (the baseline).
    """
    from ragkv.types import CachedText

    if not prompt:
        raise ValueError("the prompt is empty; pass some text")
    state = engine_state(engine)
    known = engine.chunk_registry()  # the index's chunk texts (re-read every few seconds) and registered ones
    segments = known.split(prompt) if reuse_chunks else [prompt]
    found = sum(isinstance(s, CachedText) for s in segments)
    missed = no_reuse_reason(state, len(known), prompt) if reuse_chunks and not found else None
    with state.lock:
        for delta, stats in engine.generate_segments(segments, generation=generation):
            if stats is not None:
                stats.extra["chunks_in_prompt"] = found
                if missed is not None:
                    stats.extra["reuse_warning"] = missed
            yield delta, stats


def registry(engine: RagKV, *, refresh: bool = False) -> ChunkRegistry:
    """The engine's chunk registry (:meth:`RagKV.chunk_registry`, the one the server uses too):
    its own index's chunk texts, kept in step with the catalog, and the texts frameworks register."""
    return engine.chunk_registry(refresh=refresh)


def no_reuse_reason(state: EngineState, known: int, prompt: str) -> str | None:
    """Why a prompt that looks like it carries retrieved context reuses no chunk (None: it does not look so).

    The reason is logged as a warning once per engine and reason.
    """
    low = prompt.lower()
    if not any(m in low for m in _CONTEXT_MARKERS):
        return None
    if not known:
        reason = (
            "no chunk text is known to this engine: nothing is indexed with RagKV.index and no retriever or "
            "postprocessor of ragkv registered any; add RagKVNodePostprocessor(engine) to the LlamaIndex query "
            "engine, retrieve with RagKVRetriever, or call register_texts (LangChain)"
        )
    else:
        reason = (
            f"none of the {known} chunk texts known to this engine appears in the prompt verbatim "
            "(the documents came from another retriever or splitter, or the framework rewrote or truncated "
            "them); add RagKVNodePostprocessor(engine) on the nodes that reach the prompt, or retrieve with "
            "RagKVRetriever"
        )
    if reason not in state.warned:
        state.warned.add(reason)
        logger.warning("ragkv: a prompt with retrieved context reuses no chunk cache: %s", reason)
    return reason


def warm(engine: RagKV, texts: Sequence[str], *, progress: bool = False) -> int:
    """Register ``texts`` and make sure their caches are stored and in the fast tiers; return how many were computed.

    The form warmed is the stripped text plus the separator: how frameworks lay out every chunk
    but the last, and the form ragkv's own index stores. ``progress`` shows a bar (one step per
    text) and logs each cache computed, since a first query over new texts prefills them all.
    """
    from tqdm.auto import tqdm

    from ragkv.matching import SEPARATOR

    state = engine_state(engine)
    known = engine.chunk_registry()
    known.add(texts)
    min_chars = known.config.min_chars
    forms = list(dict.fromkeys(t.strip() + SEPARATOR for t in texts if len(t.strip()) >= min_chars))
    if not forms:
        return 0
    computed = 0
    with (
        state.lock,
        tqdm(total=len(forms), desc="ragkv chunk caches", unit="chunk", disable=not progress, delay=1.0) as bar,
    ):
        for i, form in enumerate(forms, 1):
            built = engine.warm([form])
            computed += built
            if built and progress:
                logger.info("ragkv: built chunk cache %d/%d (%d chars)", i, len(forms), len(form))
            bar.update(1)
    return computed


def collect(deltas: Iterator[tuple[str, dict[str, Any] | None]]) -> tuple[str, dict[str, Any]]:
    """Drain a ``(delta, stats-or-None)`` stream into the whole text and the final stats dict."""
    parts: list[str] = []
    stats: dict[str, Any] = {}
    for delta, d in deltas:
        parts.append(delta)
        stats = d if d is not None else stats
    return "".join(parts), stats


def summarize(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One stats dict for several generations (refine, tree_summarize, condense steps).

    Counters are summed; ``ttft_ms`` is the first call's (when the first answer token appeared);
    ``calls`` keeps each call's own stats. ``reuse_warning`` is kept when every call had one.
    """
    out: dict[str, Any] = {"llm_calls": len(calls), "ttft_ms": calls[0]["ttft_ms"] if calls else 0.0}
    for key in _SUMMED:
        out[key] = sum(int(c.get(key, 0)) for c in calls)
    warnings = [c.get("reuse_warning") for c in calls]
    if calls and all(warnings):
        out["reuse_warning"] = warnings[-1]
    out["total_ms"] = round(sum(float(c.get("total_ms", 0.0)) for c in calls), 2)
    out["calls"] = [dict(c) for c in calls]
    return out


_END = object()


async def aiterate(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run the iterator ``make()`` on one worker thread and yield its items to the event loop.

    One thread for the whole stream, not one executor call per item: the engine's generator holds
    ``torch.inference_mode`` (thread-local) and the engine lock across its yields, so it must be
    resumed on the thread that started it. Stopping early closes the iterator on that thread.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    stop = threading.Event()

    def post(item: Any, err: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, err))
        except RuntimeError:  # the loop is gone; nobody is listening any more
            stop.set()

    def produce() -> None:
        try:
            it = make()
            try:
                for item in it:
                    post(item)
                    if stop.is_set():
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        except BaseException as e:  # handed to the consumer, raised there
            post(_END, e)
            return
        post(_END)

    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(produce,), name="ragkv-generate", daemon=True
    )
    thread.start()
    try:
        while True:
            item, err = await queue.get()
            if item is _END:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
