"""The Ray Serve application: an ingress in front of N engine replicas, routed by chunk affinity.

    HTTP -> Serve proxy -> Ingress (1, no model) --hint--> any replica (what chunks?)
                                               \\--forward(route=chunks)--> the replica the router picks

The ingress reads each request whole, asks one replica (power of two) which chunks a chat or
completion request will use, then forwards it with those chunks as ``route``; the router of the
engine deployment (``RequestRouterConfig``) ranks replicas by the chunk tokens their fast tiers
hold. Every other route (documents, models, health, metrics, the web page) is forwarded with no
route (power of two). The response streams back as the replica's app sends it.

``ragkv serve --ray`` builds it with :func:`build_app` and runs it; ``serve run
ragkv.replicas.app:app replicas=2`` runs it from the engine's environment settings (``RAGKV_*``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse

from ragkv.replicas.affinity import AffinityConfig, ChunkRef
from ragkv.replicas.gate import Admission, ClusterGate, MetricsBoard
from ragkv.replicas.replica import ENGINE, INGRESS, EngineReplica, RequestParts
from ragkv.server.app import METRICS_AUTH_MESSAGE, error_body, metrics_authorized
from ragkv.server.quotas import QuotaError

logger = logging.getLogger(__name__)

__all__ = ["ROUTERS", "Ingress", "ReplicaOptions", "app", "build_app", "router_config", "run_app"]

# router name -> the class Serve loads (by import path, so the ingress process imports it itself);
# None: Serve's own default router (power of two choices), left to Serve to name: its class lives
# in a private module whose path has moved between Ray releases
ROUTERS: dict[str, str | None] = {
    "affinity": "ragkv.replicas.router.ChunkAffinityRouter",
    "power_of_two": None,
    "round_robin": "ragkv.replicas.router.RoundRobinRouter",
}
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only
HINTED = ("/v1/chat/completions", "/v1/completions")  # the routes whose chunks are worth routing by


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """How the engine runs as Serve replicas and how requests are routed to them."""

    replicas: int = 2  # engine replicas (each loads the model once)
    router: str = "affinity"  # a key of ROUTERS
    cpus_per_replica: float = 1.0  # CPUs Ray reserves for each replica
    gpus_per_replica: float = 0.0  # GPUs Ray reserves for each replica (1 per replica on a GPU cluster)
    stats_period_s: float = 2.0  # how often each replica reports its holdings (a stale one costs a miss)
    sync_s: float = 5.0  # how often each replica syncs its FAISS file with the catalog (new documents elsewhere)
    holdings_limit: int = 4096  # storage keys a holdings summary lists at most
    health_period_s: float = 2.0  # Serve's health check period; a replica failing it is routed around
    health_timeout_s: float = 5.0  # ... and how long a check may take before it counts as failed
    hint_timeout_s: float = 2.0  # an ingress asks for a request's chunks this long, then routes without them
    forward_tries: int = 3  # tries of an idempotent request whose replica fails before answering
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    seed: int | None = None  # the router's random draws (tie-breaks, power of two); None: unseeded

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.forward_tries < 1:
            raise ValueError(f"forward_tries must be >= 1, got {self.forward_tries}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        for name in ("stats_period_s", "sync_s", "health_period_s", "health_timeout_s", "hint_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


class Ingress:
    """The HTTP entry: forwards every request to an engine replica, chat and completions with their chunks.

    It also keeps what holds for the whole cluster (:mod:`ragkv.replicas.gate`): the tenants'
    request-rate and concurrency quotas, one document change per tenant at a time, ``/metrics``
    (every replica's, labelled by replica) and ``/health`` (every replica's, queues and decode
    counters summed; one replica's own until the first reports arrive). A replica that fails before
    its answer starts (it died, or is being replaced) costs an idempotent request (a GET, a chat or
    completion) another try on another replica; anything else gets a 503 that says to retry.
    """

    def __init__(self, engine: Any, settings: Any, base_tenant: str, options: ReplicaOptions) -> None:
        self._engine = engine  # a DeploymentHandle to the engine deployment
        self._settings = settings
        self._max_body_bytes = settings.max_body_bytes
        self._hint_timeout_s = options.hint_timeout_s
        self._tries = options.forward_tries
        self._gate = ClusterGate(settings, base_tenant, options.replicas * replica_slots(settings))
        self._board = MetricsBoard(max_age_s=3 * options.stats_period_s + options.health_timeout_s)

    async def __call__(self, request: Any) -> Any:
        """Serve hands over a starlette Request; the answer streams from the replica's app."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            return _error(413, f"request body over this route's limit of {self._max_body_bytes} bytes; send less")
        parts = _parts(request, await request.body())
        authorization = request.headers.get("authorization", "")
        if parts.method == "GET" and parts.path == "/metrics":
            return self._metrics(authorization)
        if parts.method == "GET" and parts.path == "/health" and (health := self._board.health()) is not None:
            return _json(health, 200 if health["status"] == "ok" else 503)  # else one replica's, until they report
        try:
            admission = self._gate.admit(parts.method, parts.path, authorization)
        except QuotaError as e:
            headers = {"Retry-After": str(e.retry_after)} if e.retry_after else {}
            return _error(e.status, str(e), "rate_limit_error" if e.status == 429 else "invalid_request_error", headers)
        wanted = self._gate.document_turn(parts.method, parts.path, admission.tenant)
        turn = None  # the document turn once held (a wait cut short holds none, and releases none)
        try:
            if wanted is not None:
                await wanted.acquire()
                turn = wanted
            route = await self._route(parts) if parts.method == "POST" and parts.path in HINTED else None
            stream, start = await self._start(parts, route)
        except BaseException as e:
            self._end(admission, turn)
            if isinstance(e, Exception):
                logger.warning("no replica answered %s %s", parts.method, parts.path, exc_info=True)
                return _error(503, "the engine replica failed; retry", "server_error", {"Retry-After": "1"})
            raise
        end = _once(lambda: self._end(admission, turn))
        response = _EndingResponse(_bodies(stream, _is_event_stream(start), end), status_code=start["status"])
        response.on_end = end  # also when the body is never read (a client gone before it starts)
        response.raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        return response

    def report_metrics(self, replica: str, text: str, health: dict[str, Any] | None = None) -> None:
        """Each replica sends its /metrics text and /health body here every stats period (the
        ingress answers both for the cluster)."""
        self._board.report(replica, text, health)

    async def _start(self, parts: RequestParts, route: list[ChunkRef] | None) -> tuple[Any, dict[str, Any]]:
        """The replica's stream and its response start; an idempotent request is tried up to
        ``forward_tries`` times when a replica fails before its answer starts."""
        tries = self._tries if parts.method in ("GET", "HEAD") or parts.path in HINTED else 1
        for attempt in range(1, tries + 1):
            stream = self._engine.options(method_name="forward", stream=True).remote(parts, route=route)
            try:
                return stream, await stream.__anext__()
            except Exception:
                if attempt == tries:
                    raise
                logger.warning("a replica failed before answering %s; trying another", parts.path, exc_info=True)
                await asyncio.sleep(0.2 * attempt)  # Serve drops a dead replica from routing meanwhile
        raise AssertionError("unreachable")

    def _end(self, admission: Admission, turn: asyncio.Lock | None) -> None:
        self._gate.release(admission)
        if turn is not None:
            turn.release()

    def _metrics(self, authorization: str) -> Any:
        from starlette.responses import PlainTextResponse

        if not metrics_authorized(self._settings, authorization):
            return _error(401, METRICS_AUTH_MESSAGE, "authentication_error")
        return PlainTextResponse(self._board.render(), media_type="text/plain; version=0.0.4")

    async def _route(self, parts: RequestParts) -> list[ChunkRef] | None:
        try:
            hint = self._engine.options(method_name="hint").remote(parts)
            return list(await asyncio.wait_for(hint, self._hint_timeout_s))
        except Exception:  # no hint: the router falls back to power of two
            logger.warning("no routing hint for %s", parts.path, exc_info=True)
            return None


def _error(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> Any:
    """An OpenAI-shaped JSON error, as ``ragkv serve`` answers them."""
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind), status_code=status, headers=headers)


def _json(body: dict[str, Any], status: int) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """``action`` run on the first call only (a slot or a turn is released once, never twice)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run


class _EndingResponse(StreamingResponse):
    """A streaming response that calls ``on_end`` once it is over, however it ends."""

    on_end: Callable[[], None] = staticmethod(lambda: None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def _is_event_stream(start: dict[str, Any]) -> bool:
    headers = start.get("headers", [])
    return any(bytes(k).lower() == b"content-type" and b"text/event-stream" in bytes(v) for k, v in headers)


async def _bodies(stream: Any, event_stream: bool, on_end: Any) -> AsyncIterator[bytes]:
    """The replica's body pieces; ``on_end()`` once the response is over however it ends. A replica
    that fails mid-answer ends an event stream with an error event (a client sees why it stopped)."""
    try:
        async for message in stream:
            if message.get("type") == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
    except Exception:
        logger.warning("a replica failed mid-answer", exc_info=True)
        if event_stream:
            error = {"error": {"message": "the engine replica failed mid-answer; retry", "type": "server_error"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        on_end()


def _parts(request: Any, body: bytes) -> RequestParts:
    scope = request.scope
    client, server = scope.get("client"), scope.get("server")
    return RequestParts(
        method=scope["method"],
        path=scope["path"],
        query=scope.get("query_string", b""),
        headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
        body=body,
        client=(str(client[0]), int(client[1])) if client else None,
        server=(str(server[0]), int(server[1] or 0)) if server else None,
        scheme=scope.get("scheme", "http"),
        http_version=scope.get("http_version", "1.1"),
    )


def build_app(engine_config: Any, settings: Any, options: ReplicaOptions) -> Any:
    """The Serve application (ingress bound to the engine deployment) for ``serve.run``."""
    from ray import serve

    engine = serve.deployment(
        name=ENGINE,
        num_replicas=options.replicas,
        max_ongoing_requests=replica_slots(settings),  # past it the ingress answers 429, as ragkv serve does
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        health_check_period_s=options.health_period_s,
        health_check_timeout_s=options.health_timeout_s,
        request_router_config=router_config(options),
    )(EngineReplica).bind(engine_config, replica_settings(settings), options.holdings_limit, options.sync_s,
                          options.stats_period_s)  # fmt: skip
    ingress = serve.deployment(
        name=INGRESS,
        num_replicas=1,
        max_ongoing_requests=settings.max_connections,
        # it holds no model, it only forwards; on the head node, with Serve's controller and (in
        # docs/deployment.md's recipe) the proxy clients reach: placed on another node, the loss of
        # that node would fail every request until Serve restarted it (tests/server/test_ray_two_nodes.py)
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}},
    )(Ingress)
    return ingress.bind(engine, settings, str(engine_config.tenant), options)


def router_config(options: ReplicaOptions) -> Any:
    """Serve's ``RequestRouterConfig`` for ``options.router`` (Serve's own default class where
    :data:`ROUTERS` names none)."""
    from ray.serve.config import RequestRouterConfig

    kwargs: dict[str, Any] = {}
    if options.router == "affinity":
        kwargs = {**_fields(options.affinity), "seed": options.seed}
    fields: dict[str, Any] = {  # pydantic's fields, passed by name
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": options.stats_period_s,
        "request_routing_stats_timeout_s": max(options.stats_period_s, 5.0),
    }
    router_class = ROUTERS[options.router]
    if router_class is not None:
        fields["request_router_class"] = router_class
    return RequestRouterConfig(**fields)


def replica_slots(settings: Any) -> int:
    """Requests one replica holds at once: ``max_batch`` decoding plus ``max_queue`` waiting."""
    return int(settings.max_batch + settings.max_queue)


def replica_settings(settings: Any) -> Any:
    """The replicas' settings: the ingress counts request rates and concurrent generations for the
    whole cluster, so a replica does not count them again (its byte quotas still hold)."""
    from dataclasses import replace

    def lifted(quota: Any) -> Any:
        return replace(quota, requests_per_minute=None, concurrent=None)

    return replace(
        settings, quota=lifted(settings.quota), tenant_quotas={t: lifted(q) for t, q in settings.tenant_quotas.items()}
    )


def run_app(
    engine_config: Any, settings: Any, options: ReplicaOptions, *, address: str | None = None, blocking: bool = True
) -> Any:
    """Start (or join) Ray, start Serve on ``settings.host:port`` and run the application.

    Returns the ingress handle when ``blocking`` is False (tests, the bench); otherwise serves until
    interrupted (Ctrl-C or SIGTERM, as ``docker stop`` and systemd send it), then shuts Serve down,
    and the local Ray it started, if it started one (no Ray process outlives ``ragkv serve --ray``).
    """
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        handle = serve.run(build_app(engine_config, settings, options), name="ragkv", route_prefix="/")
    except BaseException:  # a deployment that fails leaves no Serve or Ray behind
        serve.shutdown()
        if started:
            ray.shutdown()
        raise
    if not blocking:
        return handle
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        asyncio.run(_forever())
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


async def _forever() -> None:
    while True:
        await asyncio.sleep(3600)


def _fields(record: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(record)


def app(args: dict[str, str]) -> Any:
    """``serve run ragkv.replicas.app:app replicas=2 router=affinity``: the application from the
    ``RAGKV_*`` environment (store, catalog, model, data dir) with default server settings."""
    from ragkv.cli.options import engine_config
    from ragkv.server.settings import ServerSettings

    known = {"replicas": int, "router": str, "cpus_per_replica": float, "gpus_per_replica": float}
    unknown = set(args) - set(known)
    if unknown:
        raise ValueError(f"unknown argument(s) {sorted(unknown)}; this application takes {', '.join(known)}")
    options = ReplicaOptions(**{k: known[k](v) for k, v in args.items()})  # type: ignore[arg-type]
    return build_app(engine_config(), ServerSettings(), options)
