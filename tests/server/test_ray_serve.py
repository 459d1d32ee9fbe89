"""``ragkv serve --ray``: two Ray Serve replicas of the server behind one ingress, on a local Ray.

One real run (it costs ~50 s: Ray, Serve, then each replica loads the tiny model and the embedder):
OpenAI requests (blocking and streaming, with ``cached_tokens``), API keys, a document upload seen
by both replicas, routing toward the replica that holds the chunks, a removal served by none, a
rate quota and /metrics that hold for the cluster, and a replica killed while answering.
The store is a memory tier in front of Redis, the catalog PostgreSQL, as replicas on several
machines would share them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cache.conftest import postgres_server, postgres_url, redis_server, redis_url  # noqa: F401
from tests.server.conftest import APPLES, BOATS, free_port

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.postgres]

KEY, TENANT = "sk-ray-serve-0001", "alpha"
LIMITED, LIMITED_TENANT = "sk-ray-serve-0002", "beta"  # 3 requests a minute, for the whole cluster
REPLICA = "x-ragkv-replica"


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path, redis_url: str, postgres_url: str) -> Iterator[str]:  # noqa: F811
    from ray import serve

    from ragkv.engine import EngineConfig
    from ragkv.generation import GenerationConfig
    from ragkv.replicas.app import ReplicaOptions, run_app
    from ragkv.server.quotas import TenantQuota
    from ragkv.server.settings import ServerSettings

    config = EngineConfig(
        data_dir=tmp_path / "data",  # one machine: the replicas share the FAISS file too
        model=str(tiny_model_dir),
        dtype="float32",
        store=("memory://?max_bytes=64MiB", redis_url),
        catalog=postgres_url,
        generation=GenerationConfig(max_new_tokens=8),
    )
    settings = ServerSettings(
        port=free_port(),
        api_keys={KEY: TENANT, LIMITED: LIMITED_TENANT},
        tenant_quotas={LIMITED_TENANT: TenantQuota(requests_per_minute=3)},
    )
    options = ReplicaOptions(replicas=2, stats_period_s=0.5, sync_s=1.0, seed=0)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        run_app(config, settings, options, blocking=False)
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: httpx.Client, question: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "ragkv": {"retrieve": True, "top_k": 2}, **extra}
    return client.post("/v1/chat/completions", json=body)


def listed_by_replica(client: httpx.Client, tries: int = 12) -> dict[str, set[str]]:
    """Each replica's document list, from unrouted GETs (power of two spreads them over both)."""
    seen: dict[str, set[str]] = {}
    for _ in range(tries):
        r = client.get("/v1/documents")
        assert r.status_code == 200, r.text
        seen[r.headers[REPLICA]] = {d["source"] for d in r.json()["data"]}
    return seen


def test_replicas_serve_route_by_chunks_and_share_documents(served: str) -> None:
    from openai import OpenAI

    client = httpx.Client(base_url=served, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert httpx.get(served + "/v1/models").status_code == 401  # keys hold through the ingress
    assert client.get("/health").json()["status"] == "ok"
    # a forwarded request starts the ingress's handle to the replicas, and its router with it, which
    # then takes in the replicas' holdings (/health no longer does: the ingress answers it itself)
    assert client.get("/v1/models").status_code == 200

    # an upload lands on one replica; every replica lists it (shared catalog)
    r = client.post("/v1/documents", json={"source": "mem:apples", "text": APPLES})
    assert r.status_code == 201, r.text
    holder = r.headers[REPLICA]
    assert client.post("/v1/documents", json={"source": "mem:boats", "text": BOATS}).status_code == 201
    seen = listed_by_replica(client)
    assert len(seen) == 2 and all(sources == {"mem:apples", "mem:boats"} for sources in seen.values())

    # requests whose chunks one replica holds (in its memory tier, since it indexed them) go there
    time.sleep(1.5)  # three holdings periods
    answered = []
    for _ in range(4):
        r = chat(client, "Where do apples grow? In orchards?")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        answered.append(r.headers[REPLICA])
    assert answered.count(holder) >= 3, (holder, answered)

    # the OpenAI client, streaming, with the usage chunk
    openai = OpenAI(base_url=served + "/v1", api_key=KEY)
    stream = openai.chat.completions.create(
        model="ragkv",
        messages=[{"role": "user", "content": "Where do apples grow?"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ragkv": {"retrieve": True}},
    )
    pieces = list(stream)
    assert any(p.choices and p.choices[0].delta.content for p in pieces)
    assert pieces[-1].usage is not None and pieces[-1].usage.prompt_tokens_details.cached_tokens > 0

    # a removal is served by none: the catalog rows are gone the moment DELETE answers
    docs = {d["source"]: d["id"] for d in client.get("/v1/documents").json()["data"]}
    assert client.delete(f"/v1/documents/{docs['mem:apples']}").status_code == 200
    assert all(sources == {"mem:boats"} for sources in listed_by_replica(client).values())
    for _ in range(4):
        sources = {s["source"] for s in chat(client, "Where do apples grow?").json()["ragkv"]["sources"]}
        assert "mem:apples" not in sources

    # a rate quota holds for the cluster, not per replica: the 4th request in the minute is refused
    limited = httpx.Client(base_url=served, headers={"Authorization": f"Bearer {LIMITED}"}, timeout=60)
    statuses = [limited.get("/v1/models").status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429], statuses

    # /metrics at the ingress: both replicas' samples, each labelled with its replica
    replicas = set(listed_by_replica(client))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = client.get("/metrics").text
        if "ragkv_replicas_reporting 2" in text and 'status="200"' in text:
            break
        time.sleep(0.5)
    assert "ragkv_replicas_reporting 2" in text, text[-500:]
    health = client.get("/health").json()  # the cluster's: both replicas' bodies, counters summed
    assert health["status"] == "ok" and set(health["replicas"]) == replicas, health
    assert health["decode"]["tokens"] == sum(b["decode"]["tokens"] for b in health["replicas"].values())
    for rid in replicas:  # each replica answered the document lists above
        assert f'ragkv_requests_total{{replica="{rid}",endpoint="/v1/documents",status="200"}}' in text
    assert httpx.get(served + "/metrics").status_code == 401

    # a replica killed while streams run: each in-flight answer ends whole or with a clean error,
    # nothing indexed is lost, and the other replica keeps serving
    victim = sorted(replicas)[0]
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(stream_answer, served, 256) for _ in range(4)]
        time.sleep(0.3)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::ragkv#ragkv-engine#{victim}", namespace="serve"), no_restart=True)
        outcomes = [f.result(timeout=120) for f in running]
    assert all(o in ("whole", "error event", "503") for o in outcomes), outcomes
    after = [chat(client, "How do boats travel?") for _ in range(6)]
    assert all(r.status_code == 200 for r in after), [(r.status_code, r.text[:200]) for r in after]
    assert {s["source"] for r in after for s in r.json()["ragkv"]["sources"]} == {"mem:boats"}
    assert {d["source"] for d in client.get("/v1/documents").json()["data"]} == {"mem:boats"}


def stream_answer(url: str, max_tokens: int) -> str:
    """One streamed chat: "whole" (ended with [DONE]), "error event", "503", or what else happened."""
    body = {"messages": [{"role": "user", "content": "How do boats travel?"}], "stream": True,
            "max_tokens": max_tokens, "ragkv": {"retrieve": True}}  # fmt: skip
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        try:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as e:
            return f"transport error {type(e).__name__}"
    if lines and lines[-1] == "data: [DONE]":
        return "whole"
    return "error event" if lines and '"error"' in lines[-1] else f"cut: {lines[-1:]}"
