"""``ragkv serve``: the OpenAI-compatible server (ragkv.server) on uvicorn."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from ragkv.cli.checks import check_setup
from ragkv.cli.options import (
    CatalogUrl,
    DataDir,
    Device,
    Dtype,
    Fusion,
    MaxNewTokens,
    Model,
    Offline,
    Ratio,
    SloMs,
    Store,
    Tenant,
    config_from,
)

__all__ = ["register"]


def serve(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind [127.0.0.1: loopback].")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port [8000].")] = None,
    api_keys: Annotated[
        Path | None, typer.Option("--api-keys", help="File of 'KEY TENANT' lines; every request then needs a key.")
    ] = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Requests decoded together [8].")] = None,
    step_tokens: Annotated[
        int | None,
        typer.Option("--step-tokens", help="Prompt tokens prefilled between two decode steps (0: whole) [256]."),
    ] = None,
    step_ms: Annotated[
        float | None,
        typer.Option(
            "--step-ms",
            help="A prefill piece's time while answers stream, sized from the measured prefill rate "
            "(CPU; 0: pieces of --step-tokens) [1000].",
        ),
    ] = None,
    carry_steps: Annotated[
        bool | None,
        typer.Option(
            "--carry-steps/--no-carry-steps",
            help="Decode steps ride on full-prefill pieces' forward passes (mixed batches) [carry].",
        ),
    ] = None,
    max_queue: Annotated[int | None, typer.Option("--max-queue", help="Requests held before 429 [32].")] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host", help="A Host name to answer besides loopback and --host (repeatable; '*': any)."
        ),
    ] = None,
    max_connections: Annotated[
        int | None, typer.Option("--max-connections", help="Open connections at most; more get 503 [256].")
    ] = None,
    header_timeout: Annotated[
        float | None, typer.Option("--header-timeout", help="Seconds a connection has to send a request head [10].")
    ] = None,
    quota: Annotated[
        list[str] | None,
        typer.Option("--quota", help="Every tenant's quota NAME=VALUE (repeatable; see docs/serving.md)."),
    ] = None,
    log_json: Annotated[
        bool | None, typer.Option("--log-json/--log-text", help="Access log lines as JSON [text; RAGKV_LOG_JSON].")
    ] = None,
    ray: Annotated[
        bool, typer.Option("--ray", help="Run the engine as Ray Serve replicas (pip install 'ragkv[ray]').")
    ] = False,
    replicas: Annotated[int | None, typer.Option("--replicas", help="Engine replicas with --ray [2].")] = None,
    router: Annotated[
        str | None,
        typer.Option("--router", help="With --ray: affinity (by held chunks), power_of_two or round_robin [affinity]."),
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="With --ray: a Ray cluster to join ('auto'; RAY_ADDRESS).")
    ] = None,
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    fusion: Fusion = None,
    ratio: Ratio = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve [4].")] = None,
    max_new_tokens: MaxNewTokens = None,
    dtype: Dtype = None,
    device: Device = None,
    offline: Offline = None,
    slo_ms: SloMs = None,
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API (see docs/serving.md)."""
    try:
        import uvicorn

        from ragkv.server.app import create_app
        from ragkv.server.protocol import header_timeout_protocol
        from ragkv.server.quotas import TenantQuota
        from ragkv.server.settings import ServerSettings, load_api_keys, load_tenant_quotas
    except ImportError as e:
        raise ImportError(f"ragkv serve needs the serve extra: pip install 'ragkv[serve]' ({e})") from e
    from dataclasses import replace

    if log_json is None and os.environ.get("RAGKV_LOG_JSON"):
        log_json = os.environ["RAGKV_LOG_JSON"].lower() in ("1", "true", "yes")
    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "max_batch": max_batch,
        "step_tokens": step_tokens,
        "step_ms": step_ms,
        "carry_steps": carry_steps,
        "max_queue": max_queue,
        "allowed_hosts": tuple(allowed_host) if allowed_host else None,
        "max_connections": max_connections,
        "header_timeout_s": header_timeout,
        "log_json": log_json,
        "metrics_key": os.environ.get("RAGKV_METRICS_KEY") or None,
    }
    default_quota = TenantQuota().with_words(quota or [])
    settings = ServerSettings(
        api_keys=load_api_keys(api_keys) if api_keys else {},
        quota=default_quota,
        tenant_quotas=load_tenant_quotas(api_keys, default_quota) if api_keys else {},
        **{k: v for k, v in given.items() if v is not None},
    )
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        typer.echo(
            f"warning: listening on {settings.host} without --api-keys: anyone who can reach it can use it", err=True
        )
    cfg = config_from(ctx)
    check_setup(cfg)
    if ray:
        _serve_on_ray(cfg, settings, replicas, router, ray_address)
        return
    if replicas is not None or router is not None or ray_address is not None:
        raise typer.BadParameter("--replicas, --router and --ray-address need --ray")
    from ragkv.engine import RagKV

    engine = RagKV(cfg)
    settings = replace(settings, model_name=Path(engine.model_name).name or "ragkv")
    typer.echo(f"ragkv serve: {engine.model_name} on http://{settings.host}:{settings.port}", err=True)
    if settings.access_log:
        logging.getLogger("ragkv.server.access").setLevel(logging.INFO)
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,  # ragkv.server.access writes one line per request (route template, tenant)
        timeout_graceful_shutdown=int(settings.drain_s) + 5,
        timeout_keep_alive=int(settings.keep_alive_s),
        limit_concurrency=settings.max_connections,
        http=header_timeout_protocol(settings.header_timeout_s),
    )
    _server(config, app.state.ragkv.closing).run()


def _serve_on_ray(cfg: Any, settings: Any, replicas: int | None, router: str | None, address: str | None) -> None:
    """``ragkv serve --ray``: the same app in Serve replicas behind one ingress (docs/deployment.md)."""
    from dataclasses import replace

    try:
        from ragkv.replicas.app import ReplicaOptions, run_app
    except ImportError as e:
        raise ImportError(f"ragkv serve --ray needs the ray extra: pip install 'ragkv[ray]' ({e})") from e
    given = {"replicas": replicas, "router": router}
    options = ReplicaOptions(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    settings = replace(settings, model_name=Path(cfg.model).name or "ragkv")
    typer.echo(
        f"ragkv serve --ray: {options.replicas} replicas ({options.router} routing) on "
        f"http://{settings.host}:{settings.port}",
        err=True,
    )
    run_app(cfg, settings, options, address=address or os.environ.get("RAY_ADDRESS"))


def _server(config: Any, closing: threading.Event) -> Any:
    """uvicorn's server, setting ``closing`` when a signal asks it to stop (uploads in flight then stop)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            closing.set()
            super().handle_exit(sig, frame)

    return Server(config)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``ragkv`` app."""
    app.command()(serve)
