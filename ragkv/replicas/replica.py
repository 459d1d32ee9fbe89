"""One engine replica: ``ragkv serve``'s own FastAPI app, run in process, plus what the router asks of it.

The replica builds the app exactly as ``ragkv serve`` does (:func:`ragkv.server.app.create_app`), so
keys, tenants, quotas, documents, streaming, ``cached_tokens``, ``/health`` and ``/metrics`` are the
same code; the ingress hands it each HTTP request as :class:`RequestParts` and streams back the ASGI
messages. Besides, it answers the router:

- :meth:`EngineReplica.hint`: the chunks a chat or completion request will use (the same retrieval,
  or prompt matching, the answer runs), as ``ChunkRef``s;
- :meth:`EngineReplica.record_routing_stats`: its holdings summary, every routing-stats period.

Every replica opens the configured store and catalog: with a shared store (Redis, object storage)
and catalog (PostgreSQL, or SQLite on one machine) what one indexes every other one reads, and a
replica that dies takes only its memory tier with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ragkv.replicas.affinity import ChunkRef, Holdings, key_tag
from ragkv.replicas.gate import bearer_tenant
from ragkv.server.openai_api import retrieval_query
from ragkv.types import tenant_namespace

logger = logging.getLogger(__name__)

__all__ = ["ENGINE", "INGRESS", "REPLICA_HEADER", "EngineReplica", "RequestParts", "request_chunks"]

REPLICA_HEADER = "x-ragkv-replica"  # names the replica that answered (for logs, tests and the bench)
INGRESS = "ragkv-ingress"  # the ingress deployment's name (replicas send it their metrics)
ENGINE = "ragkv-engine"  # the engine replicas' deployment name (the bench calls them through it)


@dataclass(frozen=True, slots=True)
class RequestParts:
    """One HTTP request as the ingress read it (the body whole: the app's limits still apply to it)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # as ASGI gives them: lower-case names, raw values
    body: bytes
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    def scope(self) -> dict[str, Any]:
        """The ASGI scope the app sees (as uvicorn would give it)."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query,
            "root_path": "",
            "headers": [list(h) for h in self.headers],
            "client": list(self.client) if self.client else None,
            "server": list(self.server) if self.server else None,
            "state": {},
        }


class EngineReplica:
    """A Serve replica holding one engine and ``ragkv serve``'s app (wrapped by ``serve.deployment`` in
    :func:`ragkv.replicas.app.build_app`)."""

    # Ray actors (so Serve replicas) may have an async constructor; type checkers want __init__ -> None
    async def __init__(  # type: ignore[misc]
        self, engine_config: Any, settings: Any, holdings_limit: int, sync_s: float, report_s: float = 2.0
    ) -> None:
        from ragkv.engine import RagKV
        from ragkv.server.app import create_app

        self._replica_id = _replica_id()
        self.app = create_app(RagKV(engine_config), settings)
        self.state = self.app.state.ragkv
        self.state.shared_catalog = True  # other replicas add and remove documents too
        self._holdings_limit = holdings_limit
        self._lifespan = self.app.router.lifespan_context(self.app)  # starts the scheduler, as uvicorn would
        await self._lifespan.__aenter__()
        self._stop = threading.Event()
        self._sync = threading.Thread(target=self._sync_loop, args=(sync_s,), name="ragkv-index-sync", daemon=True)
        self._sync.start()
        self._report = threading.Thread(target=self._report_loop, args=(report_s,), name="ragkv-metrics", daemon=True)
        self._report.start()
        logger.info("replica %s serving %s", self._replica_id, self.state.base.model_name)

    async def forward(self, parts: RequestParts, route: list[ChunkRef] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Run one request through the app; yields its ASGI messages (response start, then body pieces).

        ``route`` is the router's (it reads it off the call); the replica does its own retrieval, so a
        route that is out of date costs a cache miss, never a different answer.
        """
        async for message in run_asgi(self.app, parts, extra_headers=[(REPLICA_HEADER, self._replica_id)]):
            yield message

    async def hint(self, parts: RequestParts) -> list[ChunkRef]:
        """The chunks the request would use here (empty when it uses none, or cannot be read)."""
        try:
            return await asyncio.to_thread(request_chunks, self.state, parts.headers, parts.body)
        except Exception:  # a hint is advice: the request itself reports what is wrong with it
            logger.debug("no routing hint for %s", parts.path, exc_info=True)
            return []

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every ``request_routing_stats_period_s``: the holdings summary for the router."""
        from ragkv.replicas.router import HOLDINGS_STAT

        return {HOLDINGS_STAT: fast_holdings(self.state, self._holdings_limit).as_stats()}

    def stats(self) -> dict[str, Any]:
        """This replica's id, the Ray node (machine) it runs on, and its store tiers' counters
        (``ragkv bench replicas`` and the tests read them)."""
        from dataclasses import asdict

        import ray

        base = self.state.base
        tiers = {t.name: {"in_process": t.in_process, **asdict(t.stats())} for t in base.store.tiers}
        return {
            "replica": self._replica_id,
            "node": ray.get_runtime_context().get_node_id(),
            "tiers": tiers,
            "decode": self.state.scheduler.counters.as_dict(),
        }

    def check_health(self) -> None:
        """Serve's health check: a replica whose scheduler stopped is restarted (and routed around)."""
        if not self.state.scheduler.alive:
            raise RuntimeError(f"the scheduler stopped: {self.state.scheduler.failure}")

    async def __del__(self) -> None:
        self._stop.set()
        await self._lifespan.__aexit__(None, None, None)  # finishes in-flight requests, closes the engine

    def _sync_loop(self, period_s: float) -> None:
        """Every ``period_s``: each tenant's FAISS file level with the shared catalog (see ``RagKV.sync_index``)."""
        while not self._stop.wait(period_s):
            for engine in self.state.engines():
                try:
                    engine.sync_index()
                except Exception:  # a catalog that is down for a moment: the next period tries again
                    logger.warning("index sync failed for tenant %s", engine.config.tenant, exc_info=True)

    def _report_loop(self, period_s: float) -> None:
        """Every ``period_s``: this replica's /metrics text and /health body to the ingress, which
        answers the cluster's."""
        from ray import serve

        from ragkv.server.app import health_body, metrics_text

        ingress = None
        while not self._stop.wait(period_s):
            try:
                if ingress is None:
                    app_name = serve.get_replica_context().app_name
                    ingress = serve.get_deployment_handle(INGRESS, app_name=app_name)
                text, health = metrics_text(self.state), health_body(self.state)
                call = ingress.options(method_name="report_metrics").remote(self._replica_id, text, health)
                call.result(timeout_s=max(period_s, 5.0))
            except Exception:  # the ingress is starting or being replaced: the next period tries again
                logger.debug("metrics report failed", exc_info=True)


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside Serve (unit tests)
        return "local"


async def run_asgi(
    app: Any, parts: RequestParts, extra_headers: list[tuple[str, str]] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Drive ``app`` with one request; yield what it sends. Closing the iterator early is the client
    leaving: the app then hears ``http.disconnect`` (and frees the request's slot)."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": parts.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and extra_headers:
            extra = [(k.encode(), v.encode()) for k, v in extra_headers]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await queue.put(message)

    async def run() -> None:
        try:
            await app(parts.scope(), receive, send)
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not None:
            yield message
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


def request_chunks(state: Any, headers: tuple[tuple[bytes, bytes], ...], body: bytes) -> list[ChunkRef]:
    """The chunks a chat or completion request will use on a replica of ``state``: those it retrieves
    (``ragkv.retrieve``) or those its prompt holds (prompt matching), with each one's storage-key tags.

    Counts no quota and raises nothing for a bad request: an unreadable one has no chunks.
    """
    request = json.loads(body)
    if not isinstance(request, dict):
        return []
    options = request.get("ragkv") or {}
    if not isinstance(options, dict) or options.get("full"):
        return []  # a full prefill reuses nothing
    engine = _engine_for(state, headers)
    if engine is None:
        return []
    messages = [m for m in request.get("messages") or [] if isinstance(m, dict)]
    if options.get("retrieve"):
        turns = [_text(m) for m in messages if m.get("role") == "user"] or [str(request.get("prompt") or "")]
        question = retrieval_query(turns)
        if not question.strip():
            return []
        token_lists: list[tuple[int, ...]] = [c.token_ids for c in engine.retrieve(question, options.get("top_k"))]
    else:
        if messages:
            prompt = engine.render_chat([{"role": str(m.get("role")), "content": _text(m)} for m in messages])
        else:
            prompt = request.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
        if not isinstance(prompt, str) or not prompt:
            return []
        found = [s for s in engine.chunk_registry().split(prompt) if not isinstance(s, str)]
        token_lists = [tuple(engine.encode(s.text)) for s in found]  # as the answer path tokenizes them
    computer = engine.retriever.computer
    return [
        ChunkRef(tuple(key_tag(computer.chunk_key(ids, spec).storage_key) for spec in computer.codecs), len(ids))
        for ids in token_lists
    ]


def fast_holdings(state: Any, limit: int) -> Holdings:
    """What this process's fast tiers hold, over every tenant engine: memory tiers, device and host tiers."""
    base = state.base
    keys: list[str] = []
    for tier in (t for t in base.store.tiers if t.in_process):
        for engine in state.engines():
            keys.extend(tier.keys(tenant_namespace(engine.config.tenant)))
    for gpu_tier in (base.device_tier, base.host_tier):
        if gpu_tier is not None:
            keys.extend(reversed(gpu_tier.keys()))  # the least likely to be evicted first, should the limit cut
    return Holdings.of(keys, limit)


def _engine_for(state: Any, headers: tuple[tuple[bytes, bytes], ...]) -> Any:
    """The engine of the request's tenant (None for a missing or unknown key: the request will get its 401)."""
    keys = state.settings.api_keys
    if not keys:
        return state.base
    tenant = bearer_tenant(keys, dict(headers).get(b"authorization", b"").decode("latin-1"))
    return state.engine_of(tenant) if tenant is not None else None


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""
