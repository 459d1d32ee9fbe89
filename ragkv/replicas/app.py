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
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ragkv.replicas.affinity import AffinityConfig, ChunkRef
from ragkv.replicas.replica import EngineReplica, RequestParts

logger = logging.getLogger(__name__)

__all__ = ["ROUTERS", "Ingress", "ReplicaOptions", "app", "build_app", "run_app"]

# router name -> the class Serve loads (by import path, so the ingress process imports it itself)
ROUTERS = {
    "affinity": "ragkv.replicas.router.ChunkAffinityRouter",
    "power_of_two": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    "round_robin": "ragkv.replicas.router.RoundRobinRouter",
}
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
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    seed: int | None = None  # the router's random draws (tie-breaks, power of two); None: unseeded

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        for name in ("stats_period_s", "sync_s", "health_period_s", "health_timeout_s", "hint_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


class Ingress:
    """The HTTP entry: forwards every request to an engine replica, chat and completions with their chunks."""

    def __init__(self, engine: Any, max_body_bytes: int, hint_timeout_s: float) -> None:
        self._engine = engine  # a DeploymentHandle to the engine deployment
        self._max_body_bytes = max_body_bytes
        self._hint_timeout_s = hint_timeout_s

    async def __call__(self, request: Any) -> Any:
        """Serve hands over a starlette Request; the answer streams from the replica's app."""
        from starlette.responses import JSONResponse, StreamingResponse

        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            message = f"request body over {self._max_body_bytes} bytes; send less (split the upload)"
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
            return JSONResponse(body, status_code=413)
        parts = _parts(request, await request.body())
        route = await self._route(parts) if parts.method == "POST" and parts.path in HINTED else None
        stream = self._engine.options(method_name="forward", stream=True).remote(parts, route=route)
        start = await stream.__anext__()
        response = StreamingResponse(_bodies(stream), status_code=start["status"])
        response.raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        return response

    async def _route(self, parts: RequestParts) -> list[ChunkRef] | None:
        try:
            hint = self._engine.options(method_name="hint").remote(parts)
            return list(await asyncio.wait_for(hint, self._hint_timeout_s))
        except Exception:  # no hint: the router falls back to power of two
            logger.warning("no routing hint for %s", parts.path, exc_info=True)
            return None


async def _bodies(stream: Any) -> AsyncIterator[bytes]:
    async for message in stream:
        if message.get("type") == "http.response.body" and message.get("body"):
            yield bytes(message["body"])


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
    from ray.serve.config import RequestRouterConfig

    kwargs: dict[str, Any] = {}
    if options.router == "affinity":
        kwargs = {**_fields(options.affinity), "seed": options.seed}
    router_fields: dict[str, Any] = {  # pydantic's fields, passed by name
        "request_router_class": ROUTERS[options.router],
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": options.stats_period_s,
        "request_routing_stats_timeout_s": max(options.stats_period_s, 5.0),
    }
    engine = serve.deployment(
        name="ragkv-engine",
        num_replicas=options.replicas,
        max_ongoing_requests=settings.max_queue,  # the app answers 429 past its own queue, as ragkv serve does
        ray_actor_options={"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        health_check_period_s=options.health_period_s,
        health_check_timeout_s=options.health_timeout_s,
        request_router_config=RequestRouterConfig(**router_fields),
    )(EngineReplica).bind(engine_config, settings, options.holdings_limit, options.sync_s)
    ingress = serve.deployment(
        name="ragkv-ingress",
        num_replicas=1,
        max_ongoing_requests=settings.max_connections,
        ray_actor_options={"num_cpus": 0},  # it holds no model: it only forwards
    )(Ingress)
    return ingress.bind(engine, settings.max_body_bytes, options.hint_timeout_s)


def run_app(
    engine_config: Any, settings: Any, options: ReplicaOptions, *, address: str | None = None, blocking: bool = True
) -> Any:
    """Start (or join) Ray, start Serve on ``settings.host:port`` and run the application.

    Returns the ingress handle when ``blocking`` is False (tests, the bench); otherwise serves until
    interrupted, then shuts Serve down.
    """
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    handle = serve.run(build_app(engine_config, settings, options), name="ragkv", route_prefix="/")
    if not blocking:
        return handle
    try:
        asyncio.run(_forever())
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return None


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
