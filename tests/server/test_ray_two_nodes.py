"""docs/deployment.md's two-machine recipe, as far as one machine allows: two Ray nodes on this one.

``ray.cluster_utils.Cluster`` starts two raylets here, each with its own object store and one CPU,
as ``ray start --head`` and ``ray start --address`` would on two machines. The ingress and Serve's
proxy run on the head; the two engine replicas (one CPU each) land one on each node, so requests
and streamed answers cross between nodes as they would cross the network. The second node is then
removed without a drain (a machine dying): the head's replica keeps answering, and nothing
indexed is lost (the store and the catalog are shared). Costs about a minute.
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

REPLICA = "x-ragkv-replica"


@pytest.fixture
def two_nodes(
    tiny_model_dir: Path,
    tmp_path: Path,
    redis_url: str,  # noqa: F811
    postgres_url: str,  # noqa: F811
) -> Iterator[tuple[str, Any, Any]]:
    from ray import serve
    from ray.cluster_utils import Cluster

    from ragkv.engine import EngineConfig
    from ragkv.generation import GenerationConfig
    from ragkv.replicas.app import ReplicaOptions, run_app
    from ragkv.server.settings import ServerSettings

    config = EngineConfig(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        dtype="float32",
        store=("memory://?max_bytes=64MiB", redis_url),
        catalog=postgres_url,
        generation=GenerationConfig(max_new_tokens=8),
    )
    settings = ServerSettings(port=free_port())
    options = ReplicaOptions(replicas=2, stats_period_s=0.5, sync_s=1.0, health_period_s=1.0, seed=0)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        try:
            # one proxy, on the head, as clients reach machine 1 in the recipe: on one host a proxy
            # per node would share the port, and the kernel would hand connections to the dying one
            serve.start(http_options={"host": settings.host, "port": settings.port}, proxy_location="HeadOnly")
            run_app(config, settings, options, blocking=False)
            yield f"http://127.0.0.1:{settings.port}", cluster, worker
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        cluster.shutdown()


def replica_nodes() -> dict[str, str]:
    """Each engine replica's Ray node, from its stats (calls spread over the replicas until both answered)."""
    from ragkv.bench.replicas import _replica_stats

    return {rid: s["node"] for rid, s in _replica_stats(2).items()}


def chat(client: httpx.Client, question: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": question}], "ragkv": {"retrieve": True, "top_k": 2}}
    return client.post("/v1/chat/completions", json=body)


def test_replicas_on_two_nodes_serve_and_survive_losing_one(two_nodes: tuple[str, Any, Any]) -> None:
    url, cluster, worker = two_nodes
    nodes = replica_nodes()
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes  # one replica on each node
    head_replica = next(rid for rid, node in nodes.items() if node != worker.node_id)

    client = httpx.Client(base_url=url, timeout=120)
    for source, text in (("mem:apples", APPLES), ("mem:boats", BOATS)):
        r = client.post("/v1/documents", json={"source": source, "text": text})
        assert r.status_code == 201, r.text
    # both nodes' replicas list what one of them indexed (shared catalog): unrouted GETs, spread by
    # power of two over both; the chat goes where its chunks are held
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + 60
    while (
        len(seen) < 2 or any(v != {"mem:apples", "mem:boats"} for v in seen.values())
    ) and time.monotonic() < deadline:
        r = client.get("/v1/documents")
        assert r.status_code == 200, r.text
        seen[r.headers[REPLICA]] = {d["source"] for d in r.json()["data"]}
    assert set(seen) == set(nodes) and all(v == {"mem:apples", "mem:boats"} for v in seen.values()), seen
    # retrieval follows within the index sync period (sync_s = 1 s here; the catalog lists at once)
    deadline, sources = time.monotonic() + 30, set()
    while "mem:apples" not in sources and time.monotonic() < deadline:
        r = chat(client, "Where do apples grow?")
        assert r.status_code == 200, r.text
        sources = {s["source"] for s in r.json()["ragkv"]["sources"]}
    assert "mem:apples" in sources

    # the second machine dies (no drain): every request is still answered, and within Serve's
    # health checks only the head's replica answers (a replica whose node is gone is dropped)
    cluster.remove_node(worker, allow_graceful=False)
    lost = time.monotonic()
    streak, answered = 0, []
    while streak < 4 and time.monotonic() < lost + 60:
        r = chat(client, "How do boats travel?")
        assert r.status_code == 200, (r.status_code, r.text[:300])
        assert {s["source"] for s in r.json()["ragkv"]["sources"]} <= {"mem:apples", "mem:boats"}
        answered.append(r.headers[REPLICA])
        streak = streak + 1 if answered[-1] == head_replica else 0
    assert streak == 4, answered
    assert {d["source"] for d in client.get("/v1/documents").json()["data"]} == {"mem:apples", "mem:boats"}
