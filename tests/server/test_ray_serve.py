"""``ragkv serve --ray``: two Ray Serve replicas of the server behind one ingress, on a local Ray.

One real run (it costs ~40 s: Ray, Serve, then each replica loads the tiny model and the embedder):
OpenAI requests (blocking and streaming, with ``cached_tokens``), API keys, a document upload seen
by both replicas, routing toward the replica that holds the chunks, and a removal served by none.
The store is a memory tier in front of Redis, the catalog PostgreSQL, as replicas on several
machines would share them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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
REPLICA = "x-ragkv-replica"


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path, redis_url: str, postgres_url: str) -> Iterator[str]:  # noqa: F811
    from ray import serve

    from ragkv.engine import EngineConfig
    from ragkv.generation import GenerationConfig
    from ragkv.replicas.app import ReplicaOptions, run_app
    from ragkv.server.settings import ServerSettings

    config = EngineConfig(
        data_dir=tmp_path / "data",  # one machine: the replicas share the FAISS file too
        model=str(tiny_model_dir),
        dtype="float32",
        store=("memory://?max_bytes=64MiB", redis_url),
        catalog=postgres_url,
        generation=GenerationConfig(max_new_tokens=8),
    )
    settings = ServerSettings(port=free_port(), api_keys={KEY: TENANT})
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
