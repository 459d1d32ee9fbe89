"""``ragkv bench replicas``: N Ray Serve replicas of ragkv serve, routed by chunk affinity, power of two or round-robin.

One corpus is indexed once into the shared store (Redis) and catalog (PostgreSQL) through the
first deployment; then, for each router, the application is deployed afresh (so every replica's
memory tier starts empty, sized below the corpus) and the same skewed workload runs against it:
questions about documents drawn Zipf-distributed, in a seeded random order, streamed, at a fixed
concurrency. Per router: the fast-tier hit rate (memory-tier hits / lookups over all replicas),
store bytes read (bytes the lower tiers returned), TTFT p50/p95 at the client, requests per second,
and each replica's share of the requests.

Requests come either at a fixed concurrency (a closed loop: each router runs at the rate it
sustains) or, with ``rate``, as Poisson arrivals at that many per second, the same seeded times
for every router (an open loop: latencies compared at the same request rate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ragkv.bench.goodput import poisson_arrivals
from ragkv.bench.serve import percentile
from ragkv.bench.table import Column, format_table
from ragkv.replicas.affinity import AffinityConfig

__all__ = [
    "COLUMNS",
    "ReplicaBenchConfig",
    "best_hit_rate",
    "corpus",
    "format_replica_table",
    "run_replica_bench",
    "zipf_draws",
]

COLUMNS = (
    Column("router"),
    Column("requests"),
    Column("fast_hit_rate", "fast-tier hit rate", "{:.2f}"),
    Column("store_mb", "store MB read", "{:,.1f}"),
    Column("ttft_p50", "TTFT p50 ms", "{:,.0f}"),
    Column("ttft_p95", "TTFT p95 ms", "{:,.0f}"),
    Column("req_s", "req/s", "{:.2f}"),
    Column("load", "requests per replica"),
    Column("max_over_mean", "max/mean load", "{:.2f}"),
    Column("errors"),
    Column("errors_after_kill", "errors after the kill"),
)
TOPICS = ("apples", "boats", "clocks", "doors", "engines", "ferns", "glass", "harbours", "islands", "jazz", "kites",
          "lamps", "maps", "nets", "owls", "pianos", "quarries", "rivers", "salt", "tides", "umbrellas", "violins",
          "wells", "yarn")  # fmt: skip
WORDS = (
    "made",
    "with",
    "care",
    "by",
    "old",
    "craft",
    "in",
    "every",
    "season",
    "and",
    "they",
    "last",
    "for",
    "years",
    "people",
    "trade",
    "them",
    "across",
    "towns",
    "near",
    "the",
    "coast",
    "while",
    "others",
    "keep",
    "records",
)


@dataclass(frozen=True, slots=True)
class ReplicaBenchConfig:
    """One run of the bench."""

    replicas: int = 3
    routers: tuple[str, ...] = ("affinity", "power_of_two", "round_robin")
    docs: int = 24  # documents in the corpus
    requests: int = 48  # questions per router
    concurrency: int = 3  # requests in flight
    zipf: float = 1.1  # skew: document i is asked about with weight 1 / (i + 1) ** zipf
    memory_share: float = 0.4  # each replica's memory tier, as a share of the corpus's stored bytes
    max_tokens: int = 4  # answer tokens per request (the bench is about prefill and loading)
    top_k: int = 2
    seed: int = 0
    kill_after: int = 0  # > 0: one more affinity run, whose busiest replica is killed after this many answers
    rate: float = 0.0  # > 0: Poisson arrivals at this many requests per second (concurrency unused); 0: closed loop
    affinity: AffinityConfig | None = None  # the affinity router's weights (None: its defaults)

    def __post_init__(self) -> None:
        for name in ("replicas", "docs", "requests", "concurrency", "max_tokens", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.kill_after < self.requests:
            raise ValueError(f"kill_after must be in [0, requests), got {self.kill_after}")
        if not 0 < self.memory_share < 1:
            raise ValueError(f"memory_share must be in (0, 1) (the corpus must not fit), got {self.memory_share}")
        if not self.rate >= 0:
            raise ValueError(f"rate must be >= 0 requests/s (0: a closed loop at the concurrency), got {self.rate}")


def corpus(n: int, seed: int) -> list[tuple[str, str, str]]:
    """``n`` invented documents as (source, text, question): a distinct topic each, a few paragraphs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = f"{TOPICS[i % len(TOPICS)]} of district {i}"
        paragraphs = [
            f"This note is about {topic}. " + " ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(4)
        ]
        out.append((f"bench:{i}", "\n\n".join(paragraphs), f"What is known about {topic}?"))
    return out


def zipf_draws(n_docs: int, n: int, s: float, seed: int) -> list[int]:
    """``n`` document indexes, index i drawn with weight ``1 / (i + 1) ** s``, in random order.

    >>> draws = zipf_draws(10, 1000, 1.1, 0)
    >>> draws.count(0) > draws.count(9) * 5
    True
    """
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** s for i in range(n_docs)]
    return rng.choices(range(n_docs), weights=weights, k=n)


def run_replica_bench(
    engine_config: Any,
    settings: Any,
    config: ReplicaBenchConfig,
    echo: Callable[[str], None] = print,
    on_indexed: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Index the corpus once, then one row per router (see the module docstring).

    ``on_indexed`` runs once the corpus is indexed, before any measured run (the bench's limited
    link starts there, so indexing is not slowed by it).
    """
    import ray
    from ray import serve

    from ragkv.replicas.app import ReplicaOptions, build_app

    docs = corpus(config.docs, config.seed)
    url = f"http://127.0.0.1:{settings.port}"
    ray.init(
        num_cpus=max(config.replicas, 2), include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": settings.port})
        options = ReplicaOptions(replicas=config.replicas, seed=config.seed, stats_period_s=1.0)
        if config.affinity is not None:
            options = replace(options, affinity=config.affinity)
        t0 = time.perf_counter()
        serve.run(build_app(engine_config, settings, options), name="ragkv", route_prefix="/")
        echo(f"{config.replicas} replicas up in {time.perf_counter() - t0:.0f} s; indexing {len(docs)} documents")
        _index(url, docs)
        time.sleep(2 * options.sync_s)  # every replica's index sync has run: the routing hints see the corpus
        corpus_bytes = _lower_tier_bytes_in(_replica_stats(config.replicas))
        memory = max(1 << 20, int(corpus_bytes * config.memory_share))
        echo(f"corpus: {corpus_bytes / 1e6:.1f} MB stored; each replica's memory tier: {memory / 1e6:.1f} MB")
        if on_indexed is not None:
            on_indexed()
        store = (f"memory://?max_bytes={memory}", *[u for u in engine_config.store if not u.startswith("memory")])
        measured = replace(engine_config, store=store)
        draws = zipf_draws(config.docs, config.requests, config.zipf, config.seed)
        routes = _routes([docs[i][2] for i in draws], config)
        best = best_hit_rate(routes)
        echo(f"workload: {sum(map(len, routes))} chunk uses of {len({c for r in routes for c in r})} distinct chunks; "
             f"a hit rate above {best:.2f} is impossible (each distinct chunk's first use is a miss)")  # fmt: skip
        rows = []
        for router in config.routers:
            options = replace(options, router=router)
            t0 = time.perf_counter()
            serve.run(build_app(measured, settings, options), name="ragkv", route_prefix="/")
            echo(f"{router}: deployed in {time.perf_counter() - t0:.0f} s")
            before = _replica_stats(config.replicas)
            results, wall = asyncio.run(_workload(url, [docs[i][2] for i in draws], config))
            after = _replica_stats(config.replicas)
            row = _row(router, results, wall, before, after, config.replicas)
            settings_of = {"affinity_config": asdict(options.affinity)} if router == "affinity" else {}
            rows.append(row | {"best_hit_rate": best, "rate": config.rate} | settings_of)
        if config.kill_after:
            serve.run(
                build_app(measured, settings, replace(options, router="affinity")), name="ragkv", route_prefix="/"
            )
            echo(f"affinity again; its busiest replica is killed after {config.kill_after} answers")
            before = _replica_stats(config.replicas)
            results, wall = asyncio.run(
                _workload(url, [docs[i][2] for i in draws], config, kill_after=config.kill_after)
            )
            after = _replica_stats(config.replicas - 1)  # the killed one is restarted with empty counters, if up
            row = _row("affinity, 1 killed", results, wall, before, after, config.replicas)
            rows.append(row | {"rate": config.rate, "affinity_config": asdict(options.affinity)})
        return rows
    finally:
        serve.shutdown()
        ray.shutdown()


def best_hit_rate(routes: Sequence[Sequence[Any]]) -> float:
    """The fast-tier hit rate no router can pass on ``routes`` (each request's chunks): every distinct
    chunk's first use is a miss wherever it goes, and each later use could at best be a hit.

    >>> round(best_hit_rate([["a", "b"], ["a"], ["a", "c"]]), 2)
    0.4
    """
    uses = sum(len(r) for r in routes)
    return 1 - len({c for r in routes for c in r}) / uses if uses else 0.0


def _routes(questions: Sequence[str], config: ReplicaBenchConfig) -> list[list[tuple[str, ...]]]:
    """Each question's chunks (their storage-key tags), as the ingress's routing hint finds them:
    a retrieval on one replica, which loads nothing into its tiers."""
    from ray import serve

    from ragkv.replicas.replica import ENGINE, RequestParts

    handle = serve.get_deployment_handle(ENGINE, app_name="ragkv").options(method_name="hint")
    routes = []
    for question in questions:
        body = {"messages": [{"role": "user", "content": question}], "ragkv": {"retrieve": True, "top_k": config.top_k}}
        parts = RequestParts("POST", "/v1/chat/completions", b"", ((b"content-type", b"application/json"),),
                             json.dumps(body).encode())  # fmt: skip
        routes.append([tuple(c.tags) for c in handle.remote(parts).result(timeout_s=60)])
    return routes


def _index(url: str, docs: Sequence[tuple[str, str, str]]) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=600) as client:
        body = [{"source": s, "text": t} for s, t, _ in docs]
        r = client.post("/v1/documents", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"indexing the bench corpus failed ({r.status_code}): {r.text[:500]}")


def _replica_stats(replicas: int, tries: int = 60) -> dict[str, dict[str, Any]]:
    """Every engine replica's ``stats()``: calls through a handle until each replica has answered
    once (the deployment's router spreads unrouted calls over all of them)."""
    from ray import serve

    from ragkv.replicas.replica import ENGINE

    engine = serve.get_deployment_handle(ENGINE, app_name="ragkv")
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        found = engine.options(method_name="stats").remote().result()
        seen[found["replica"]] = found
        if len(seen) >= replicas:
            break
    return seen


def _kill_replica(replica_id: str) -> None:
    """Kill one engine replica's actor, as a machine that dies would (no drain, no restart of that actor)."""
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::ragkv#ragkv-engine#{replica_id}", namespace="serve"), no_restart=True)


def _lower_tier_bytes_in(stats: dict[str, dict[str, Any]]) -> int:
    """Bytes written to the lasting tiers (what one copy of the corpus's caches takes)."""
    return max((t["bytes_in"] for s in stats.values() for t in s["tiers"].values() if not t["in_process"]), default=0)


async def _workload(
    url: str, questions: Sequence[str], config: ReplicaBenchConfig, kill_after: int = 0
) -> tuple[list[dict[str, Any]], float]:
    """Every question, at ``config.concurrency`` or (with ``config.rate``) at seeded Poisson arrival
    times; with ``kill_after``, the replica that answered most so far is killed (Ray kills its actor;
    Serve starts another) once that many have answered."""
    import httpx

    results: list[dict[str, Any]] = []
    killed: list[str] = []

    async def ask(client: httpx.AsyncClient, question: str) -> None:
        started_after_kill = bool(killed)  # those in flight at the kill may fail; these should not
        result = await _one(client, question, config)
        result["after_kill"] = started_after_kill
        results.append(result)
        if kill_after and len(results) == kill_after and not killed:
            busiest = Counter(r["replica"] for r in results if "replica" in r).most_common(1)
            if busiest:
                killed.append(busiest[0][0])
                await asyncio.to_thread(_kill_replica, busiest[0][0])

    async def worker(client: httpx.AsyncClient, queue: asyncio.Queue[str]) -> None:
        while not queue.empty():
            await ask(client, queue.get_nowait())

    async def arrivals(client: httpx.AsyncClient) -> None:
        tasks = []
        for at, question in zip(poisson_arrivals(len(questions), config.rate, config.seed), questions, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(ask(client, question)))
        await asyncio.gather(*tasks)

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        if config.rate > 0:
            await arrivals(client)
        else:
            queue: asyncio.Queue[str] = asyncio.Queue()
            for q in questions:
                queue.put_nowait(q)
            await asyncio.gather(*(worker(client, queue) for _ in range(config.concurrency)))
    return results, time.perf_counter() - start


async def _one(client: Any, question: str, config: ReplicaBenchConfig) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": config.max_tokens,
        "stream": True,
        "ragkv": {"retrieve": True, "top_k": config.top_k},
    }
    start = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": r.status_code}
            replica = r.headers.get("x-ragkv-replica", "?")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                piece = json.loads(line[6:])
                if ttft is None and any(c.get("delta", {}).get("content") for c in piece.get("choices", [])):
                    ttft = (time.perf_counter() - start) * 1000
    except Exception as e:  # a failed request is counted, not fatal: the bench reports errors
        return {"error": type(e).__name__}
    return {"replica": replica, "ttft": ttft if ttft is not None else (time.perf_counter() - start) * 1000}


def _row(
    router: str,
    results: list[dict[str, Any]],
    wall: float,
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    replicas: int,
) -> dict[str, Any]:
    def delta(rid: str, fast: bool, field: str) -> int:
        old = before.get(rid, {}).get("tiers", {})
        return sum(
            t[field] - old.get(name, {}).get(field, 0)
            for name, t in after[rid]["tiers"].items()
            if t["in_process"] == fast
        )

    hits = sum(delta(r, True, "hits") for r in after)
    lookups = hits + sum(delta(r, True, "misses") for r in after)
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in ok]
    load = Counter(r["replica"] for r in ok)
    counts = [load.get(r, 0) for r in sorted(after)] + [0] * (replicas - len(after))
    mean = sum(counts) / max(1, len(counts))
    return {
        "router": router,
        "requests": len(results),
        "fast_hit_rate": hits / lookups if lookups else 0.0,
        "store_mb": sum(delta(r, False, "bytes_out") for r in after) / 1e6,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "req_s": len(ok) / wall if wall else 0.0,
        "load": "/".join(str(c) for c in counts),
        "max_over_mean": max(counts) / mean if mean else 0.0,
        "errors": len(results) - len(ok),
        "errors_after_kill": sum("error" in r for r in results if r.get("after_kill")) if "killed" in router else "-",
    }


def format_replica_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table, plus the ratios the issue's targets are stated in (affinity against each baseline)."""
    out = [format_table(rows, COLUMNS)]
    by = {r["router"]: r for r in rows}
    aff = by.get("affinity")
    if aff is not None:
        rr, p2 = by.get("round_robin"), by.get("power_of_two")
        if rr and rr["fast_hit_rate"]:
            out.append(f"fast-tier hit rate, affinity / round-robin: {aff['fast_hit_rate'] / rr['fast_hit_rate']:.2f}x")
        if rr and rr["store_mb"]:
            out.append(f"store bytes read, affinity / round-robin: {aff['store_mb'] / rr['store_mb']:.2f}x")
        if p2 and p2["ttft_p95"]:
            out.append(f"TTFT p95, affinity / power of two: {aff['ttft_p95'] / p2['ttft_p95']:.2f}x")
        if aff.get("best_hit_rate"):
            out.append(f"best possible fast-tier hit rate on this workload: {aff['best_hit_rate']:.2f} "
                       f"(affinity reaches {aff['fast_hit_rate'] / aff['best_hit_rate']:.2f} of it)")  # fmt: skip
    return "\n".join(out)
