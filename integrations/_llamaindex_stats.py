"""Getting each answer's ragkv stats into LlamaIndex's ``Response.metadata`` and chat responses.

The LLM is called deep inside a synthesizer or chat engine, which builds the response object
itself; the LLM never sees it. LlamaIndex's instrumentation does: a span handler opens a stats
sink when a synthesizer, query engine or chat engine method starts, the LLM records into every
open sink of its context, and when the method returns, the sink's summary is put under
``metadata["ragkv"]`` of what it returned.

Beside the summed per-call stats the summary carries what only the span sees: ``ttft_ms`` as the
user sees it (from the start of the query or chat call to the first token of its last LLM call,
the one whose answer the user gets: retrieval, cache building and refine's earlier calls
included), ``llm_ttft_ms`` (that last call's own time to first token), and ``cache_build_ms`` /
``caches_built`` (chunk caches computed by the postprocessor before the LLM ran).

A streaming response is returned before its tokens exist. The LLM captures the open sinks when it
is called (inside the method) and records when its stream ends; the summary dict attached to the
response is updated in place, so it is complete once the stream has been consumed.
"""

from __future__ import annotations

import inspect
import threading
import time
from contextvars import ContextVar
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.span import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from pydantic import PrivateAttr

from ragkv.integrations._bridge import STATS_KEY, summarize

__all__ = ["StatsSink", "current_sinks", "install", "record", "record_build"]

_SINKS: ContextVar[tuple[StatsSink, ...]] = ContextVar("ragkv_llamaindex_sinks", default=())
_TRACKED_METHODS = frozenset(
    {"synthesize", "asynthesize", "query", "aquery", "chat", "achat", "stream_chat", "astream_chat"}
)
_INSTALLED = threading.Lock()
_installed: list[StatsSpanHandler] = []


class StatsSink:
    """The stats of the LLM calls made within one synthesizer / query engine / chat engine call."""

    def __init__(self) -> None:
        self.started = time.perf_counter()  # the tracked call began (the user's clock starts)
        self.calls: list[dict[str, Any]] = []
        self.last_first_token = self.started  # perf_counter of the last call's first token
        self.build_ms = 0.0
        self.built = 0
        self.summary: dict[str, Any] = self._summarize()  # updated in place: streaming responses hold it
        self.used = False  # an LLM call captured this sink (maybe still streaming)
        self._lock = threading.Lock()

    def add(self, stats: dict[str, Any], first_token_at: float | None = None) -> None:
        """Record one LLM call's stats; ``first_token_at`` is the perf_counter of its first token."""
        with self._lock:
            self.calls.append(stats)
            if first_token_at is not None:
                self.last_first_token = first_token_at
            self._refresh()

    def add_build(self, ms: float, built: int) -> None:
        """Record chunk caches built on the query path (by the postprocessor)."""
        with self._lock:
            self.build_ms += ms
            self.built += built
            self._refresh()

    def _refresh(self) -> None:
        fresh = self._summarize()
        self.summary.clear()
        self.summary.update(fresh)

    def _summarize(self) -> dict[str, Any]:
        out = summarize(self.calls)
        if self.calls:
            out["llm_ttft_ms"] = self.calls[-1].get("ttft_ms", 0.0)
            out["ttft_ms"] = round((self.last_first_token - self.started) * 1000, 2)
        out["cache_build_ms"] = round(self.build_ms, 2)
        out["caches_built"] = self.built
        return out


def current_sinks() -> tuple[StatsSink, ...]:
    """The sinks open in this context; an LLM call captures them when it starts."""
    sinks = _SINKS.get()
    for s in sinks:
        s.used = True
    return sinks


def record(sinks: tuple[StatsSink, ...], stats: dict[str, Any], first_token_at: float | None = None) -> None:
    for s in sinks:
        s.add(stats, first_token_at)


def record_build(ms: float, built: int) -> None:
    """Add cache-building time to every sink open in this context (and mark them used)."""
    for s in current_sinks():
        s.add_build(ms, built)


_tracked_types: tuple[type, ...] = ()


def _tracked(id_: str, instance: Any) -> bool:
    global _tracked_types
    if not _tracked_types:  # imported on first use: llama_index.core imports are heavy
        from llama_index.core.base.base_query_engine import BaseQueryEngine
        from llama_index.core.chat_engine.types import BaseChatEngine
        from llama_index.core.response_synthesizers.base import BaseSynthesizer

        _tracked_types = (BaseSynthesizer, BaseQueryEngine, BaseChatEngine)
    method = id_.split("-", 1)[0].rsplit(".", 1)[-1]  # span ids are "<Class>.<method>-<uuid>"
    return method in _TRACKED_METHODS and isinstance(instance, _tracked_types)


class StatsSpanHandler(BaseSpanHandler[BaseSpan]):
    """Opens a sink per tracked span and attaches its summary to the span's result."""

    _open: dict[str, StatsSink] = PrivateAttr(default_factory=dict)

    @classmethod
    def class_name(cls) -> str:
        return "RagKVStatsSpanHandler"

    def span_enter(
        self,
        id_: str,
        bound_args: Any,
        instance: Any = None,
        parent_id: str | None = None,
        tags: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not _tracked(id_, instance):
            return
        sink = StatsSink()
        with self.lock:
            self._open[id_] = sink
        # set in the caller's own context (the dispatcher calls this right before the method body)
        _SINKS.set((*_SINKS.get(), sink))

    def span_exit(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None, **kwargs: Any) -> None:
        active = _SINKS.get()
        sink = self._close(id_)
        if sink is None:
            return
        # A streaming response's generator calls the LLM lazily, after this span is gone: bind
        # the sinks open now to the generator, so the LLM call it makes records into them.
        gen = vars(result).get("response_gen") if hasattr(result, "__dict__") else None
        if inspect.isgenerator(gen) or inspect.isasyncgen(gen):
            result.response_gen = _bind(gen, active)
            for s in active:
                s.used = True
        if sink.used:
            _attach(result, sink.summary)

    def span_drop(
        self, id_: str, bound_args: Any, instance: Any = None, err: BaseException | None = None, **kwargs: Any
    ) -> None:
        self._close(id_)

    def _close(self, id_: str) -> StatsSink | None:
        with self.lock:
            sink = self._open.pop(id_, None)
        if sink is not None:
            _SINKS.set(tuple(s for s in _SINKS.get() if s is not sink))
        return sink

    # BaseSpanHandler's span bookkeeping is not used: span_enter/exit/drop above replace it.
    def new_span(self, *args: Any, **kwargs: Any) -> BaseSpan | None:
        return None

    def prepare_to_exit_span(self, *args: Any, **kwargs: Any) -> BaseSpan | None:
        return None

    def prepare_to_drop_span(self, *args: Any, **kwargs: Any) -> BaseSpan | None:
        return None


def _attach(result: Any, summary: dict[str, Any]) -> None:
    from llama_index.core.chat_engine.types import StreamingAgentChatResponse

    if hasattr(result, "metadata"):
        if result.metadata is None:
            result.metadata = {}
        result.metadata[STATS_KEY] = summary
    elif isinstance(result, StreamingAgentChatResponse):
        # no metadata field on this one; an attribute of the same name keeps the access uniform
        result.metadata = {STATS_KEY: summary}  # type: ignore[attr-defined]


def _bind(gen: Any, sinks: tuple[StatsSink, ...]) -> Any:
    """``gen`` run with ``sinks`` open in whatever context consumes it."""

    def enter() -> tuple[StatsSink, ...]:
        extra = tuple(s for s in sinks if s not in _SINKS.get())
        _SINKS.set((*_SINKS.get(), *extra))
        return extra

    def leave(extra: tuple[StatsSink, ...]) -> None:
        _SINKS.set(tuple(s for s in _SINKS.get() if s not in extra))

    if inspect.isasyncgen(gen):

        async def abound() -> Any:
            extra = enter()
            try:
                async for item in gen:
                    yield item
            finally:
                leave(extra)

        return abound()

    def bound() -> Any:
        extra = enter()
        try:
            yield from gen
        finally:
            leave(extra)

    return bound()


def install() -> None:
    """Add the stats span handler to LlamaIndex's root dispatcher (once per process)."""
    with _INSTALLED:
        if not _installed:
            handler = StatsSpanHandler()
            get_dispatcher().add_span_handler(handler)
            _installed.append(handler)
