"""The app factory: routes for documents, health, metrics and the web page, around the OpenAI routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragkv.server import documents, openai_api
from ragkv.server.settings import ServerSettings
from ragkv.server.state import ApiError, ServerState

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

STATIC = Path(__file__).parent / "static"
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


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
        state.scheduler.start()
        yield
        await asyncio.to_thread(state.close)  # finishes (or cancels) in-flight requests

    app = FastAPI(title="ragkv", lifespan=lifespan)
    app.state.ragkv = state
    _errors(app)
    app.include_router(openai_api.router(state))
    app.include_router(documents.router(state))
    _service(app, state)
    app.add_middleware(_Limits, state=state)  # type: ignore[arg-type]
    return app


class _Limits:
    """Refuses bodies over the limit (413) and counts every request by route and status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.settings.max_body_bytes
        headers = dict(scope.get("headers") or [])
        status = {"code": 500}
        if int(headers.get(b"content-length", b"0") or 0) > limit:
            return await self._too_large(scope, receive, send, limit)
        seen = {"bytes": 0}

        async def counted_receive() -> Any:
            message = await receive()
            seen["bytes"] += len(message.get("body", b""))
            if seen["bytes"] > limit:
                raise ApiError(413, f"request body over {limit} bytes")
            return message

        async def recorded_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, counted_receive, recorded_send)
        finally:
            self.state.metrics.count_request(_endpoint(scope["path"]), status["code"])

    async def _too_large(self, scope: Scope, receive: Any, send: Any, limit: int) -> None:
        body = _error_body(
            f"request body over this server's limit of {limit} bytes; send less", "invalid_request_error"
        )
        await JSONResponse(body, status_code=413)(scope, receive, send)
        self.state.metrics.count_request(_endpoint(scope["path"]), 413)


def _endpoint(path: str) -> str:
    if path.startswith("/static/"):
        return "/static"  # one metrics label for the page's files, not one per file
    return "/v1/documents/{id}" if path.startswith("/v1/documents/") else path


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _errors(app: FastAPI) -> None:
    """Every error is a JSON body in OpenAI's shape; bad input is a 4xx, never a traceback."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = exc.kind if isinstance(exc, ApiError) else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in exc.errors()
        )
        return JSONResponse(_error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(_error_body("internal error; see the server log", "server_error"), status_code=500)


def _service(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics and the web page at / (its scripts and licenses under /static)."""

    @app.get("/health")
    async def health() -> Any:
        waiting, decoding = state.scheduler.depth
        tiers = state.base.store.health()
        alive = state.scheduler.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "scheduler": "running" if alive else f"stopped: {state.scheduler.failure}",
            "model": state.base.adapter.name,
            "waiting": waiting,
            "decoding": decoding,
            "max_batch": state.settings.max_batch,
            "max_queue": state.settings.max_queue,
            "tiers": tiers,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.scheduler.depth, state.tier_counts(), state.scheduler.steps)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")  # vendored, so the page needs no CDN
