"""What one server process holds: the tenants' engines (one shared model), the scheduler, metrics, auth."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import HTTPException, Request

from ragkv.driver import Event, Job, JobRequest, QueueFullError, Scheduler, queued_post
from ragkv.matching import ChunkRegistry
from ragkv.server.metrics import Metrics
from ragkv.server.quotas import QuotaError, Quotas
from ragkv.server.settings import ServerSettings

logger = logging.getLogger(__name__)

__all__ = ["ApiError", "ServerState"]


class ApiError(HTTPException):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **headers: str) -> None:
        super().__init__(status_code=status, detail=message, headers=headers or None)
        self.kind = kind


class ServerState:
    """The base engine (its tenant is the server's default), one engine per tenant sharing its model."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.base, self.settings = engine, settings
        self.metrics = Metrics()
        self.quotas = Quotas(settings.quota, settings.tenant_quotas)
        self._text_bytes: dict[str, int] = {}  # per tenant: UTF-8 bytes of its indexed chunk texts
        self._uploading: dict[str, int] = {}  # per tenant: bytes of uploads admitted and still indexing
        self._upload_turns: dict[str, asyncio.Lock] = {}  # per tenant: held by the upload indexing now
        self._turn_loop: asyncio.AbstractEventLoop | None = None  # the loop the turns belong to
        self.scheduler = Scheduler(
            engine.adapter,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            decode_weights=engine.decode_weights,  # every tenant's engine shares the base engine's model
            step_tokens=settings.step_tokens or None,
            step_ms=settings.step_ms or None,
            carry=settings.carry_steps,
        )
        self.scheduler.on_finish = self._finished
        self._engines: dict[str, Any] = {engine.config.tenant: engine}
        self._lock = threading.RLock()  # guards the dicts below, held only briefly
        self._making: dict[str, threading.Lock] = {}  # per tenant: held while its engine is made
        # set when the process is told to stop (SIGTERM): uploads in flight stop at their next step and
        # answer 503 naming what was indexed, before uvicorn's drain runs out and cuts them to a bare 500
        self.closing = threading.Event()
        # True where other processes change the catalog too (Serve replicas): a tenant's document bytes
        # are read from it afresh before each upload's quota check
        self.shared_catalog = False
        self._register(engine)

    # ---- tenants ------------------------------------------------------------------------------
    def tenant_of(self, request: Request) -> str:
        """The tenant a request acts for: its bearer key's (with --api-keys), else the server's own."""
        keys = self.settings.api_keys
        if not keys:
            return self._admit_request(request, str(self.base.config.tenant))
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        tenant = keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            what = "no API key given" if not auth else "unknown API key"
            raise ApiError(
                401,
                f"{what}: send 'Authorization: Bearer KEY' with a key from the server's --api-keys file",
                "authentication_error",
            )
        return self._admit_request(request, tenant)

    def _admit_request(self, request: Request, tenant: str) -> str:
        request.state.tenant = tenant  # for the access log
        try:
            self.quotas.count_request(tenant)
        except QuotaError as e:
            raise ApiError(e.status, str(e), "rate_limit_error", **{"Retry-After": "60"}) from e
        return tenant

    async def engine(self, request: Request) -> Any:
        """The engine of the request's tenant (made on first use, on a worker thread: it reads the
        tenant's catalog and FAISS file, which must not stall the event loop)."""
        tenant = self.tenant_of(request)
        with self._lock:
            engine = self._engines.get(tenant)
        return engine if engine is not None else await asyncio.to_thread(self.engine_of, tenant)

    def engine_of(self, tenant: str) -> Any:
        """``tenant``'s engine, made on first use (blocking: call it off the event loop)."""
        with self._lock:
            making = self._making.setdefault(tenant, threading.Lock())
        with making:  # one tenant's slow start holds up only that tenant's requests (_lock is held briefly)
            with self._lock:
                engine = self._engines.get(tenant)
            if engine is None:
                engine = self.base.for_tenant(tenant)
                self._register(engine)
                with self._lock:
                    self._engines[tenant] = engine
        return engine

    def engines(self) -> list[Any]:
        """Every tenant engine made so far, the base engine first."""
        with self._lock:
            return list(self._engines.values())

    def _register(self, engine: Any) -> None:
        """Make the tenant's indexed chunk texts findable in client-sent prompts (the engine's own
        registry, as the integrations use it) and note their bytes for the document quota."""
        texts = engine.chunk_texts()
        engine.chunk_registry(refresh=True)
        with self._lock:
            self._text_bytes[engine.config.tenant] = sum(len(t.encode()) for t in texts)

    def check_upload(self, engine: Any, adding_text: int) -> None:
        """Raises ApiError 413 when ``engine``'s tenant may not add ``adding_text`` bytes of documents."""
        tenant = engine.config.tenant
        stored_bytes = engine.stored_bytes()
        fresh = sum(len(t.encode()) for t in engine.chunk_texts()) if self.shared_catalog else None
        with self._lock:  # uploads still indexing count too: parallel uploads cannot pass the quota together
            if fresh is not None:
                self._text_bytes[tenant] = fresh
            stored = self._text_bytes.get(tenant, 0) + self._uploading.get(tenant, 0)
            try:
                self.quotas.check_upload(tenant, stored, adding_text, stored_bytes)
            except QuotaError as e:
                raise ApiError(e.status, str(e)) from e
            self._uploading[tenant] = self._uploading.get(tenant, 0) + adding_text

    async def admit_upload(self, engine: Any, adding_text: int) -> None:
        """Wait for the tenant's upload in progress to finish, then :meth:`check_upload`.

        One upload per tenant indexes at a time (its engine indexes one at a time anyway), so each
        one's quota check sees the caches the one before it stored: three concurrent uploads cannot
        each pass ``cache_bytes`` on the usage from before any of them (issue 33). The turn ends
        with :meth:`upload_done`.
        """
        tenant = engine.config.tenant
        with self._lock:
            turn = self._upload_turns.setdefault(tenant, asyncio.Lock())
        await turn.acquire()
        try:
            await asyncio.to_thread(self.check_upload, engine, adding_text)
        except BaseException:
            turn.release()
            raise
        self._turn_loop = asyncio.get_running_loop()

    def upload_done(self, engine: Any, adding_text: int) -> None:
        """Release what :meth:`admit_upload` reserved, once the upload is indexed (or failed); any thread."""
        tenant = engine.config.tenant
        with self._lock:
            left = self._uploading.get(tenant, 0) - adding_text
            if left > 0:
                self._uploading[tenant] = left
            else:
                self._uploading.pop(tenant, None)
            turn = self._upload_turns.get(tenant)
        if turn is not None and turn.locked() and self._turn_loop is not None:
            self._turn_loop.call_soon_threadsafe(turn.release)

    def registry(self, engine: Any) -> ChunkRegistry:
        """The chunk texts of ``engine``'s tenant, for finding them in client-sent prompts."""
        return engine.chunk_registry()  # type: ignore[no-any-return]

    def refresh(self, engine: Any) -> None:
        """Re-read the tenant's chunk texts after documents were added or removed."""
        self._register(engine)

    # ---- generation -----------------------------------------------------------------------------
    async def run(self, request: JobRequest) -> tuple[Job, AsyncIterator[Event], Event]:
        """Queue a generation; wait until it is prefilled. Returns (job, its remaining events, ``started``).

        Raises ApiError: 429 when the queue is full, 400 for a prompt the model cannot take.
        """
        queue: asyncio.Queue[Event] = asyncio.Queue()
        tenant = request.engine.config.tenant  # type: ignore[attr-defined]
        try:
            self.quotas.start_generation(tenant)
        except QuotaError as e:
            raise ApiError(e.status, str(e), "rate_limit_error", **{"Retry-After": "1"}) from e
        job = Job(request, post=_releasing(queued_post(asyncio.get_running_loop(), queue), self.quotas, tenant))
        try:
            self.scheduler.submit(job)
        except QueueFullError as e:
            self.quotas.end_generation(tenant)
            raise ApiError(429, f"{e}; retry shortly", "rate_limit_error", **{"Retry-After": "1"}) from e
        except RuntimeError as e:
            self.quotas.end_generation(tenant)
            raise ApiError(503, str(e), "server_error") from e
        try:
            first = await queue.get()
        except BaseException:
            job.cancel()
            raise
        if first.kind == "error":
            err = first.error
            if not self.scheduler.alive:
                raise ApiError(503, str(err), "server_error")
            status = 400 if isinstance(err, ValueError | TypeError) else 500
            message = str(err) if status == 400 else "generation failed; see the server log"
            raise ApiError(status, message, "invalid_request_error" if status == 400 else "server_error")

        async def rest() -> AsyncIterator[Event]:
            try:
                while True:
                    event = await queue.get()
                    yield event
                    if event.kind in ("done", "error"):
                        return
            finally:
                job.cancel()  # a client that left frees its slot at the next step (no-op when done)

        return job, rest(), first

    def _finished(self, job: Job, stats: Any, how: str) -> None:
        if stats is not None:
            self.metrics.observe_generation(stats, how)

    def tier_counts(self) -> dict[str, tuple[int, int, int]]:
        return {name: (s.hits, s.misses, s.errors) for name, s in self.base.tier_stats().items()}

    def close(self) -> None:
        self.scheduler.stop(self.settings.drain_s)
        self.base.close()


def _releasing(post: Callable[[Event], None], quotas: Quotas, tenant: str) -> Callable[[Event], None]:
    """``post`` that frees the tenant's generation slot with the job's last event (done or error)."""
    released = threading.Event()

    def wrapped(event: Event) -> None:
        if event.kind in ("done", "error") and not released.is_set():
            released.set()
            quotas.end_generation(tenant)
        post(event)

    return wrapped
