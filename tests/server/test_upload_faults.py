"""Uploads under faults and races (issue 33): concurrent uploads cannot pass the cache quota together;
one tenant filling a shared bounded tier neither locks out another's upload nor turns it into a 502."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ragkv.server.quotas import TenantQuota
from ragkv.types import tenant_namespace

ALPHA, BETA = "sk-faults-alpha-1", "sk-faults-beta-22"
KEYS = {ALPHA: "alpha", BETA: "beta"}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _doc(name: str, words: int = 60) -> dict[str, str]:
    return {"source": name, "text": " ".join(f"{name}-{i} grows in the orchard." for i in range(words))}


@pytest.fixture
def serve(llama_adapter, tmp_path: Path) -> Iterator[Any]:
    """``serve(store, **settings)``: a TestClient on an app whose engine stores in ``store`` only."""
    from fastapi.testclient import TestClient

    from ragkv.engine import EngineConfig, RagKV
    from ragkv.generation import GenerationConfig
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.server.app import create_app
    from ragkv.server.settings import ServerSettings

    opened: list[Any] = []

    def make(store: tuple[str, ...], **settings: Any) -> Any:
        cfg = EngineConfig(
            data_dir=tmp_path,
            store=store,
            generation=GenerationConfig(max_new_tokens=4),
            retriever=RetrieverConfig(chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        )
        engine = RagKV(cfg, adapter=llama_adapter, embedder=HashingEmbedder(dim=64))
        client = TestClient(create_app(engine, ServerSettings(**settings)), base_url="http://127.0.0.1")
        opened.append(client.__enter__())
        return client

    yield make
    for client in opened:
        client.__exit__(None, None, None)


def test_concurrent_uploads_cannot_pass_the_cache_quota_together(serve, tmp_path):
    client = serve((str(tmp_path / "kv"),), api_keys=KEYS, tenant_quotas={"alpha": TenantQuota(cache_bytes=1024)})

    def upload(i: int) -> int:
        return client.post("/v1/documents", json=_doc(f"doc{i}"), headers=_auth(ALPHA)).status_code

    with ThreadPoolExecutor(3) as pool:
        codes = sorted(pool.map(upload, range(3)))
    assert codes == [201, 413, 413]  # the first stored more than 1 KiB: the others see it
    r = client.post("/v1/documents", json=_doc("late"), headers=_auth(ALPHA))
    assert r.status_code == 413 and "cache_bytes quota of 1024" in r.json()["error"]["message"]
    assert client.post("/v1/documents", json=_doc("beta"), headers=_auth(BETA)).status_code == 201


def test_one_tenant_filling_a_shared_tier_does_not_lock_out_another(serve, tmp_path):
    client = serve((f"disk://{tmp_path / 'kv'}?max_bytes=96KiB",), api_keys=KEYS)
    engine = client.app.state.ragkv.base
    for i in range(6):  # alpha fills the tier past its budget (its own oldest entries are evicted)
        client.post("/v1/documents", json=_doc(f"alpha{i}"), headers=_auth(ALPHA))
    ((_, held),) = [u for u in engine.store.usage(tenant_namespace("alpha")).values() if u is not None]
    assert held > 80 * 1024  # the tier is full of alpha's caches
    r = client.post("/v1/documents", json=_doc("beta", 20), headers=_auth(BETA))
    assert r.status_code == 201, r.text
    assert r.json()["failed"] == 0 and r.json()["bytes_stored"] > 0


def test_a_full_tier_is_507_naming_its_limit_never_502(serve, tmp_path):
    client = serve((f"disk://{tmp_path / 'kv'}?max_bytes=1MiB&tenant_max_bytes=1KiB",))
    r = client.post("/v1/documents", json=_doc("big"))
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["failed"] >= 1 and body["failed_documents"] == ["big"]
    assert "tenant_max_bytes=1024" in body["error"]["message"] and body["error"]["type"] == "insufficient_storage"
    assert client.get("/v1/documents").json()["data"] == []


def test_every_request_gets_an_access_log_line_404_included(make_client, caplog):
    import logging

    client = make_client()
    with caplog.at_level(logging.INFO, logger="ragkv.server.access"):
        assert client.get("/no/such/path").status_code == 404
        assert client.get("/static/no-such-file.js").status_code == 404
        assert client.post("/v1/no-such-route", json={}).status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "ragkv.server.access"]
    assert len(lines) == 3, lines
    assert all("status=404" in line for line in lines)
