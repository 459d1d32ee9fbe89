"""The app factory: routes for documents, health, metrics and the web page, around the OpenAI routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragkv.server import documents, openai_api
from ragkv.server.guard import Guard
from ragkv.server.settings import ServerSettings
from ragkv.server.state import ApiError, ServerState

logger = logging.getLogger(__name__)

__all__ = [
    "METRICS_AUTH_MESSAGE",
    "create_app",
    "error_body",
    "health_body",
    "metrics_authorized",
    "metrics_text",
]

STATIC = Path(__file__).parent / "static"
_TIER_WORDS = {"closed": "reachable", "half-open": "unreachable (retrying)", "open": "unreachable"}


def create_app(engine_or_config: Any, settings: ServerSettings | None = None) -> FastAPI:
    """The ``ragkv serve`` ASGI app.

    Args:
        engine_or_config: a ``RagKV`` (its tenant is the default one, its model is shared by every
            tenant) or an ``EngineConfig`` to build one from.
        settings: listening, limits and API keys.
    """
    from ragkv.engine import EngineConfig, RagKV

    engine = RagKV(engine_or_config) if isinstance(engine_or_config, EngineConfig) else engine_or_config
    state = ServerState(engine, settings or ServerSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(_capture_graphs, engine)
        state.scheduler.start()
        yield
        await asyncio.to_thread(state.close)  # finishes (or cancels) in-flight requests

    app = FastAPI(title="ragkv", lifespan=lifespan)
    app.state.ragkv = state
    _errors(app)
    app.include_router(openai_api.router(state))
    app.include_router(documents.router(state))
    _service(app, state)
    app.add_middleware(Guard, state=state)  # type: ignore[arg-type]
    return app


def _capture_graphs(engine: Any) -> None:
    """On a GPU, the fused prefill's layer graphs for every row bucket before the first request
    (``ragkv.gpu.graphs``): otherwise the first request of each bucket pays its captures. ragkv's
    Triton kernels are compiled and checked first (``ragkv.gpu.feed.warm_kernels``), for the same
    reason."""
    adapter = getattr(engine, "adapter", None)
    if adapter is None or adapter.device.type != "cuda":
        return
    from ragkv.gpu.feed import warm_kernels
    from ragkv.gpu.graphs import capture_all

    warm_kernels(adapter)  # a wrong RAGKV_TRITON stops the start with its message (every fused request would fail)
    began = time.perf_counter()
    try:
        made = capture_all(adapter)
    except Exception:  # the server runs without them: each pass then captures (or runs eagerly) on first use
        logger.exception("capturing the layer graphs at start failed; requests capture them on first use")
        return
    logger.info("captured the layer graphs of %d row buckets in %.1f s", made, time.perf_counter() - began)


def error_body(message: str, kind: str) -> dict[str, Any]:
    """An error as OpenAI answers it: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _errors(app: FastAPI) -> None:
    """Every error is a JSON body in OpenAI's shape; bad input is a 4xx, never a traceback."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = exc.kind if isinstance(exc, ApiError) else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in exc.errors()
        )
        return JSONResponse(error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal error; see the server log", "server_error"), status_code=500)


def metrics_authorized(settings: ServerSettings, authorization: str) -> bool:
    """Whether ``authorization`` may read /metrics: anyone without keys configured, else a bearer key
    that is an API key or the metrics key (compared in constant time)."""
    if not settings.api_keys and settings.metrics_key is None:
        return True
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    known = [*settings.api_keys, *([settings.metrics_key] if settings.metrics_key else [])]
    return scheme.lower() == "bearer" and any(hmac.compare_digest(key.encode(), k.encode()) for k in known)


METRICS_AUTH_MESSAGE = "/metrics needs 'Authorization: Bearer KEY' (an API key or the --metrics-key)"


def _metrics_auth(state: ServerState, request: Request) -> None:
    """With API keys (or a metrics key) configured, /metrics needs one of them as its bearer key."""
    if not metrics_authorized(state.settings, request.headers.get("authorization", "")):
        raise ApiError(401, METRICS_AUTH_MESSAGE, "authentication_error")


def metrics_text(state: ServerState) -> str:
    """This process's /metrics body (Prometheus text)."""
    return state.metrics.render(state.scheduler.depth, state.tier_counts(), state.scheduler.steps)


def health_body(state: ServerState) -> dict[str, Any]:
    """``/health``'s body: ``status`` ("ok" or "unavailable"), the model, the scheduler's queue and
    decode counters, and the store tiers' states (``ragkv serve --ray``'s ingress gathers each
    replica's, :class:`ragkv.replicas.gate.MetricsBoard`)."""
    waiting, decoding = state.scheduler.depth
    # the store's circuit states ("closed" = in use) in plain words
    tiers = {name: _TIER_WORDS.get(how, how) for name, how in state.base.tier_health().items()}
    alive = state.scheduler.alive
    body = {
        "status": "ok" if alive else "unavailable",
        "scheduler": "running" if alive else f"stopped: {state.scheduler.failure}",
        # model, dtype (what every figure of this server is computed in) and why, decode weights
        # ("model", or an opt-in quantized decode copy)
        **state.base.model_info(),
        "waiting": waiting,
        "decoding": decoding,
        "max_batch": state.settings.max_batch,
        "step_tokens": state.settings.step_tokens,  # prefill piece size between decode steps (0: whole)
        "step_ms": state.settings.step_ms,  # ... or its time, on a CPU (0: step_tokens)
        "piece_tokens": state.scheduler.piece_tokens,  # a piece's size now while streams decode
        "carry_steps": state.settings.carry_steps,  # decode steps may ride on full-prefill pieces
        "decode": state.scheduler.counters.as_dict(),  # steps, tokens, ms per token outside the forward
        "max_queue": state.settings.max_queue,
        "tiers": tiers,
    }
    if state.base.device_tier is not None:  # decoded chunk caches on the GPU: entries, bytes, hits
        body["device_tier"] = state.base.device_tier.stats()
    if state.base.host_tier is not None:  # ... and behind it in pinned host memory
        body["host_tier"] = state.base.host_tier.stats()
    return body


def _service(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics and the web page at / (its scripts and licenses under /static)."""

    @app.get("/health")
    async def health() -> Any:
        body = health_body(state)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        _metrics_auth(state, request)
        return PlainTextResponse(metrics_text(state), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")  # vendored, so the page needs no CDN
