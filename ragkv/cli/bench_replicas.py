"""``ragkv bench replicas``: Ray Serve replicas under a skewed workload, by router (registered on ``bench_app``)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ragkv.cli.bench import JsonOut, _write_rows, bench_app, rerun_in_namespace
from ragkv.cli.options import Model, engine_config

__all__: list[str] = []

LINK_REDIS_PORT = 6399  # the Redis --link-mbit starts inside its network namespace


@bench_app.command("replicas")
def bench_replicas(
    replicas: Annotated[int, typer.Option("--replicas", help="Engine replicas.", min=1)] = 3,
    routers: Annotated[
        str, typer.Option("--routers", help="Routers to compare, comma-separated.")
    ] = "affinity,power_of_two,round_robin",
    docs: Annotated[int, typer.Option("--docs", help="Documents in the corpus.", min=1)] = 24,
    requests: Annotated[int, typer.Option("--requests", help="Questions per router.", min=1)] = 48,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests in flight.", min=1)] = 3,
    zipf: Annotated[float, typer.Option("--zipf", help="Skew over documents (weight 1/(i+1)^s).")] = 1.1,
    memory_share: Annotated[
        float, typer.Option("--memory-share", help="Each replica's memory tier, as a share of the corpus's bytes.")
    ] = 0.4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer tokens per request.", min=1)] = 4,
    redis: Annotated[
        str | None, typer.Option("--redis", help="Redis URL of the shared store [RAGKV_TEST_REDIS_URL].")
    ] = None,
    postgres: Annotated[
        str | None, typer.Option("--postgres", help="PostgreSQL URL of the catalog [RAGKV_TEST_POSTGRES_URL].")
    ] = None,
    port: Annotated[int, typer.Option("--port", help="Port Serve listens on.")] = 8011,
    seed: Annotated[int, typer.Option("--seed", help="Corpus, workload order and router draws.")] = 0,
    kill_after: Annotated[
        int,
        typer.Option(
            "--kill-after",
            help="One more affinity run whose busiest replica is killed after N answers [0: none].",
            min=0,
        ),
    ] = 0,
    rate: Annotated[
        float,
        typer.Option(
            "--rate",
            help="Poisson arrivals at this many requests/s, the same times for every router [0: --concurrency].",
            min=0.0,
        ),
    ] = 0.0,
    link_mbit: Annotated[
        float | None,
        typer.Option(
            "--link-mbit",
            help="Reach the store over a link of this many Mbit/s: runs in a network namespace with its own "
            "Redis and a SQLite catalog (tbf on loopback; needs root) [none: the services' Redis, PostgreSQL].",
            min=0.1,
        ),
    ] = None,
    load_weight: Annotated[
        float | None,
        typer.Option("--load-weight", help="Affinity router: score lost at a full load term [its default].", min=0.0),
    ] = None,
    load_cap: Annotated[
        int | None,
        typer.Option("--load-cap", help="Affinity router: queue length of a full load term [its default].", min=1),
    ] = None,
    balance: Annotated[
        float | None,
        typer.Option("--balance", help="Affinity router: bounded-load factor (0: off) [its default]."),
    ] = None,
    window: Annotated[
        int | None,
        typer.Option(
            "--window", help="Affinity router: recent routes the share bound counts (0: off) [its default].", min=0
        ),
    ] = None,
    window_balance: Annotated[
        float | None,
        typer.Option("--window-balance", help="Affinity router: the share bound's factor [its default]."),
    ] = None,
    model: Model = None,
    out: JsonOut = None,
) -> None:
    """Fast-tier hit rate, store bytes read, TTFT and req/s of N Ray Serve replicas, by router, in one run.

    Needs ragkv[ray,postgres] and Redis and PostgreSQL (bash .ci/services.sh starts both on loopback);
    with --link-mbit, root (and redis-server, tc, unshare) instead of the running services.
    """
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from ragkv.bench import netns
    from ragkv.bench.replicas import ReplicaBenchConfig, format_replica_table, run_replica_bench
    from ragkv.replicas.affinity import AffinityConfig
    from ragkv.server.settings import ServerSettings

    defaults = AffinityConfig()
    try:
        config = ReplicaBenchConfig(
            replicas=replicas,
            routers=tuple(r.strip() for r in routers.split(",") if r.strip()),
            docs=docs,
            requests=requests,
            concurrency=concurrency,
            zipf=zipf,
            memory_share=memory_share,
            max_tokens=max_tokens,
            seed=seed,
            kill_after=kill_after,
            rate=rate,
            affinity=AffinityConfig(
                load_weight=defaults.load_weight if load_weight is None else load_weight,
                load_cap=defaults.load_cap if load_cap is None else load_cap,
                balance=defaults.balance if balance is None else balance,
                window=defaults.window if window is None else window,
                window_balance=defaults.window_balance if window_balance is None else window_balance,
            ),
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if link_mbit is not None and (redis or postgres):
        raise typer.BadParameter(
            "--link-mbit runs its own Redis and a SQLite catalog inside a network namespace (the services on "
            "the host's loopback are outside it): drop --redis/--postgres, or drop --link-mbit"
        )
    if link_mbit is not None:
        rerun_in_namespace()  # from here on, inside it
    data_dir = Path(tempfile.mkdtemp(prefix="ragkv-bench-replicas-"))
    if link_mbit is not None:  # inside the namespace: its own Redis (through the limited loopback), SQLite catalog
        redis, postgres = f"redis://127.0.0.1:{LINK_REDIS_PORT}/0", f"sqlite:///{data_dir / 'catalog.db'}"
    redis = redis or os.environ.get("RAGKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    postgres = postgres or os.environ.get(
        "RAGKV_TEST_POSTGRES_URL", "postgresql+psycopg://ragkv:ragkv@127.0.0.1:5432/ragkv_test"
    )
    # a fresh key prefix and data dir: the run starts from an empty store, whatever ran before
    prefix = f"ragkv-bench-{os.getpid()}-{seed}:"
    cfg = replace(engine_config(model=model), data_dir=data_dir, store=(f"{redis}?prefix={prefix}",), catalog=postgres)
    settings = ServerSettings(port=port, max_tokens_limit=max(64, max_tokens))
    redis_proc = netns.start_redis(data_dir, LINK_REDIS_PORT) if link_mbit is not None else None

    def limit_link() -> None:
        if link_mbit is not None:
            netns.set_rate(link_mbit)
            typer.echo(f"the store's link: {link_mbit:g} Mbit/s from here on (tbf on loopback)", err=True)

    try:
        rows = run_replica_bench(
            cfg, settings, config, echo=lambda line: typer.echo(line, err=True), on_indexed=limit_link
        )
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=30)
    rows = [row | {"link_mbit": link_mbit} for row in rows]
    typer.echo(format_replica_table(rows))
    typer.echo("(timings from one machine; replicas share its cores)", err=True)
    _write_rows(rows, out)
