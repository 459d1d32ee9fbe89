"""The OpenAI-compatible endpoints: chat completions, completions, models, embeddings.

A blocking answer is the sum of its stream (one code path computes text, usage and stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ragkv.driver import Event, JobRequest
from ragkv.generation import GenerationConfig
from ragkv.server.state import ApiError, ServerState
from ragkv.types import Chunk, GenerationStats

__all__ = ["FOLLOW_UP_WORDS", "QUERY_MAX_CHARS", "rag_question", "retrieval_query", "router"]

FOLLOW_UP_WORDS = 8  # a user turn shorter than this leans on the one before ("and what does it return?")
FOLLOW_UP_TURNS = 2  # earlier user turns a short question may pull in
QUERY_MAX_CHARS = 2000  # the retrieval query keeps its last this many characters
HISTORY_MAX_CHARS = 4000  # earlier turns the model reads after the chunks keep their last this many characters


class RagkvOptions(BaseModel):
    """The ``ragkv`` body field: server-side retrieval and the prefill mode."""

    model_config = ConfigDict(extra="forbid")
    retrieve: bool = False  # retrieve from the tenant's index and answer in ragkv's RAG layout
    top_k: int | None = Field(default=None, ge=1, le=64)  # chunks to retrieve [the engine's top_k]
    full: bool = False  # prefill everything (the baseline) instead of reusing chunk caches


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, logprobs...) are ignored
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # torch's generator takes 64-bit seeds
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    ragkv: RagkvOptions = Field(default_factory=RagkvOptions)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    input: str | list[str]
    model: str | None = None


def _generation(state: ServerState, engine: Any, req: _Sampling, max_tokens: int | None) -> GenerationConfig:
    """The engine's generation defaults with what the request set (temperature defaults to greedy)."""
    limit = state.settings.max_tokens_limit
    if max_tokens is not None and max_tokens > limit:
        raise ApiError(400, f"max_tokens={max_tokens} is over this server's limit of {limit}; ask for fewer")
    base: GenerationConfig = engine.config.generation
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return replace(
        base,
        max_new_tokens=max_tokens or min(base.max_new_tokens, limit),
        temperature=base.temperature if req.temperature is None else req.temperature,
        top_p=base.top_p if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop or base.stop,
    )


def _ragkv_info(stats: GenerationStats, sources: list[Chunk], found: int | None) -> dict[str, Any]:
    info = stats.as_dict()
    info["sources"] = [{"source": c.source, "chunk": c.ordinal, "score": c.score, "text": c.text} for c in sources]
    if found is not None:
        info["chunks_in_prompt"] = found
    return info


def _usage(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    }


async def _prepare(
    state: ServerState,
    request: Request,
    req: _Sampling,
    prompt: str | None,
    chat: list[Message] | None,
    max_tokens: int | None,
) -> tuple[JobRequest, list[Chunk], int | None]:
    """The job's request, the retrieved sources and how many cached chunks the client's prompt held."""
    engine = await state.engine(request)
    gen = _generation(state, engine, req, max_tokens)
    mode = "full" if req.ragkv.full else "reuse"
    if req.ragkv.retrieve:
        question = retrieval_query([m.text() for m in chat or [] if m.role == "user"] or [prompt or ""])
        if not question.strip():
            raise ApiError(400, "retrieve needs a question: send a user message (or a prompt) with text")
        try:
            sources = await asyncio.to_thread(engine.retrieve, question, req.ragkv.top_k)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        asked = rag_question([(m.role, m.text()) for m in chat]) if chat else ""
        rag = ([c.text for c in sources], asked or question)
        return JobRequest(engine, gen, mode, rag=rag), sources, None
    if chat is not None:
        prompt = engine.render_chat([{"role": m.role, "content": m.text()} for m in chat])
    if not prompt:
        raise ApiError(400, "the prompt is empty; send some text")
    segments = state.registry(engine).split(prompt) if mode == "reuse" else [prompt]
    found = sum(not isinstance(s, str) for s in segments)
    return JobRequest(engine, gen, mode, segments=segments), [], found


def retrieval_query(user_turns: list[str]) -> str:
    """What server-side retrieval searches with: the last user turn, with context when it is a short follow-up.

    While the query has fewer than ``FOLLOW_UP_WORDS`` words, the user turn before it is put in
    front (at most ``FOLLOW_UP_TURNS`` of them), one per line, so "and what does it return?"
    searches together with the question it follows. A self-contained question stands alone, so a
    change of topic does not drag the old one in. Assistant turns are never used (they may be
    wrong, and they repeat the retrieved text). The query is capped at its last
    ``QUERY_MAX_CHARS`` characters.

    >>> retrieval_query(["What does heappush do?", "And what does it return?"])
    'What does heappush do?\\nAnd what does it return?'
    >>> retrieval_query(["What does heappush do?", "How do lighthouses guide ships along rocky coasts at night?"])
    'How do lighthouses guide ships along rocky coasts at night?'
    """
    turns = [t.strip() for t in user_turns if t.strip()]
    if not turns:
        return ""
    kept = [turns[-1]]
    for earlier in reversed(turns[-1 - FOLLOW_UP_TURNS : -1]):
        if sum(len(t.split()) for t in kept) >= FOLLOW_UP_WORDS:
            break
        kept.insert(0, earlier)
    return "\n".join(kept)[-QUERY_MAX_CHARS:]


def rag_question(messages: list[tuple[str, str]]) -> str:
    """The question the model reads after the retrieved chunks, with the conversation it belongs to.

    Only the text after the chunks changes from turn to turn, so a multi-turn chat still reuses
    every chunk cache. Returns "" for a single-turn chat (the caller keeps its retrieval query, as
    before); otherwise the last user turn, then the earlier user and assistant turns, oldest
    first, capped at their last ``HISTORY_MAX_CHARS`` characters, then the last user turn again:
    with the history last, qwen2.5-0.5b answered the earlier question instead. System turns are
    left out (the layout has its own system prompt).

    >>> rag_question([("user", "Where do apples grow?")])
    ''
    >>> print(rag_question([("user", "Where do apples grow?"), ("assistant", "In orchards."), ("user", "When?")]))
    When?
    <BLANKLINE>
    Earlier in this conversation:
    user: Where do apples grow?
    assistant: In orchards.
    <BLANKLINE>
    Answer the last question: When?
    """
    turns = [(role, text.strip()) for role, text in messages if role in ("user", "assistant") and text.strip()]
    last = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=-1)
    if last <= 0:
        return ""
    history = "\n".join(f"{role}: {text}" for role, text in turns[:last])[-HISTORY_MAX_CHARS:]
    question = turns[last][1]
    return f"{question}\n\nEarlier in this conversation:\n{history}\n\nAnswer the last question: {question}"


def _embedding_body(engine: Any, texts: list[str], model: str) -> bytes:
    """The /v1/embeddings answer, encoded (on a worker thread: a large one took seconds to build)."""
    vectors = engine.embedder.embed(texts)
    data = [{"object": "embedding", "index": i, "embedding": [float(x) for x in v]} for i, v in enumerate(vectors)]
    tokens = sum(len(t.split()) for t in texts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json.dumps({"object": "list", "data": data, "model": model, "usage": usage}).encode()


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _respond(
    state: ServerState,
    request: Request,
    req: _Sampling,
    kind: str,
    prompt: str | None,
    chat: list[Message] | None,
    max_tokens: int | None,
) -> Any:
    job_request, sources, found = await _prepare(state, request, req, prompt, chat, max_tokens)
    _, events, _ = await state.run(job_request)
    head = {
        "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": req.model or state.settings.model_name,
    }

    def piece(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if role:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}
        return {
            **head,
            "object": "text_completion",
            "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}],
        }

    async def stream() -> AsyncIterator[bytes]:
        if kind == "chat":
            yield _sse(piece("", None, role=True))
        async for ev in events:
            if ev.kind == "delta":
                yield _sse(piece(ev.text, None))
            elif ev.kind == "done" and ev.stats is not None:
                request.state.cached_tokens = ev.stats.reused_tokens
                last = piece(None, _finish(ev.stats))
                last["ragkv"] = _ragkv_info(ev.stats, sources, found)
                yield _sse(last)
                include = req.stream_options is not None and req.stream_options.include_usage
                if include:
                    yield _sse({**head, "object": last["object"], "choices": [], "usage": _usage(ev.stats)})
            elif ev.kind == "error":
                yield _sse({"error": {"message": "generation failed", "type": "server_error"}})
        yield b"data: [DONE]\n\n"

    if req.stream:
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    collected = await _collect_unless_gone(request, events)
    if collected is None:  # the client left: its slot is free already; nobody reads this answer
        return Response(status_code=499)
    text, final = collected
    request.state.cached_tokens = final.reused_tokens
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": _finish(final),
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": _finish(final), "logprobs": None}
        obj = "text_completion"
    body = {
        **head,
        "object": obj,
        "choices": [choice],
        "usage": _usage(final),
        "ragkv": _ragkv_info(final, sources, found),
    }
    return JSONResponse(body)


async def _collect_unless_gone(request: Request, events: AsyncIterator[Event]) -> tuple[str, GenerationStats] | None:
    """A blocking answer's text and stats; None when the client disconnected first.

    The request's body has been read, so the next ASGI message is the client's disconnect: waiting
    for it beside the generation lets a client that leaves free its slot now, not at max_tokens.
    """

    async def collect() -> tuple[str, GenerationStats]:
        parts: list[str] = []
        final: GenerationStats | None = None
        async for ev in events:
            parts.append(ev.text)
            final = ev.stats if ev.kind == "done" else final
        if final is None:
            raise ApiError(500, "generation failed; see the server log", "server_error")
        return "".join(parts), final

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # closes the events iterator, which cancels the job
            with contextlib.suppress(asyncio.CancelledError):
                await work
            await events.aclose()  # type: ignore[attr-defined]
    return work.result() if not work.cancelled() else None


def _finish(stats: GenerationStats) -> str:
    return "length" if stats.extra.get("finish_reason") == "length" else "stop"


def router(state: ServerState) -> APIRouter:
    """The /v1 OpenAI-compatible routes bound to ``state``."""
    api = APIRouter(prefix="/v1")

    @api.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _respond(state, request, req, "chat", None, req.messages, max_tokens)

    @api.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt[:1])
        if isinstance(req.prompt, list) and len(req.prompt) > 1:
            raise ApiError(400, "send one prompt per request (a list of several prompts is not supported)")
        return await _respond(state, request, req, "completion", prompt, None, req.max_tokens)

    @api.get("/models")
    async def models(request: Request) -> Any:
        state.tenant_of(request)
        name = state.settings.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ragkv"}]}

    @api.post("/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> Any:
        engine = await state.engine(request)
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise ApiError(400, "input must be a non-empty string or a list of non-empty strings")
        limits = state.settings
        if len(texts) > limits.max_embedding_inputs:
            raise ApiError(413, f"{len(texts)} inputs; this server embeds at most {limits.max_embedding_inputs} "
                           "per request (max_embedding_inputs): send them in batches")  # fmt: skip
        chars = sum(len(t) for t in texts)
        if chars > limits.max_embedding_chars:
            raise ApiError(413, f"inputs of {chars} characters in all; this server takes at most "
                           f"{limits.max_embedding_chars} per request (max_embedding_chars): send fewer")  # fmt: skip
        body = await asyncio.to_thread(_embedding_body, engine, texts, req.model or "ragkv-embedder")
        return Response(body, media_type="application/json")

    return api
