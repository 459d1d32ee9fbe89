"""Per-tenant quotas (F4, item 3): over its quota a tenant gets 429/413 naming the limit; others go on."""

from __future__ import annotations

import pytest

from ragkv.server.quotas import QuotaError, Quotas, TenantQuota
from ragkv.server.settings import load_api_keys, load_tenant_quotas

ALPHA, BETA = "sk-quota-alpha-1", "sk-quota-beta-22"
KEYS = {ALPHA: "alpha", BETA: "beta"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_requests_per_minute_limits_only_that_tenant(make_client):
    client = make_client(api_keys=KEYS, tenant_quotas={"alpha": TenantQuota(requests_per_minute=3)})
    assert [client.get("/v1/models", headers=_auth(ALPHA)).status_code for _ in range(3)] == [200] * 3
    r = client.get("/v1/models", headers=_auth(ALPHA))
    assert r.status_code == 429 and "requests_per_minute quota of 3" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    assert all(client.get("/v1/models", headers=_auth(BETA)).status_code == 200 for _ in range(5))


def test_the_rate_window_slides():
    quotas = Quotas(TenantQuota(requests_per_minute=2), {})
    quotas.count_request("a", now=0.0)
    quotas.count_request("a", now=1.0)
    with pytest.raises(QuotaError, match="requests_per_minute"):
        quotas.count_request("a", now=59.0)
    quotas.count_request("a", now=60.5)  # the first one left the window
    quotas.count_request("b", now=59.0)


def test_concurrent_generations_are_bounded_per_tenant():
    quotas = Quotas(TenantQuota(concurrent=1), {"b": TenantQuota(concurrent=2)})
    quotas.start_generation("a")
    with pytest.raises(QuotaError, match="concurrent quota of 1") as e:
        quotas.start_generation("a")
    assert e.value.status == 429
    quotas.start_generation("b")
    quotas.start_generation("b")
    quotas.end_generation("a")
    quotas.start_generation("a")


def test_generation_slots_come_back_after_each_answer(make_client):
    client = make_client(api_keys=KEYS, quota=TenantQuota(concurrent=1))
    state = client.app.state.ragkv
    for _ in range(3):  # each answer frees its slot, or the second would be refused
        assert client.post("/v1/chat/completions", json=CHAT, headers=_auth(ALPHA)).status_code == 200
        assert (
            client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=_auth(ALPHA)).status_code == 200
        )
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 9000}]},
                      headers=_auth(ALPHA))  # fmt: skip
    assert bad.status_code == 400  # over the tiny model's context: refused, and its slot is back
    assert state.quotas.running("alpha") == 0


def test_document_bytes_quota_is_413_for_that_tenant_only(make_client):
    client = make_client(api_keys=KEYS, tenant_quotas={"alpha": TenantQuota(document_bytes=1000)})
    text = "Apples grow on trees in orchards. " * 20  # 680 bytes
    assert client.post("/v1/documents", json={"source": "a1", "text": text}, headers=_auth(ALPHA)).status_code == 201
    r = client.post("/v1/documents", json={"source": "a2", "text": text}, headers=_auth(ALPHA))
    assert r.status_code == 413 and "document_bytes quota of 1000" in r.json()["error"]["message"]
    assert client.post("/v1/documents", json={"source": "b1", "text": text}, headers=_auth(BETA)).status_code == 201
    assert client.post("/v1/documents", json={"source": "b2", "text": text}, headers=_auth(BETA)).status_code == 201


def test_cache_bytes_quota_stops_uploads_once_reached(make_client):
    client = make_client(api_keys=KEYS, tenant_quotas={"alpha": TenantQuota(cache_bytes=1)})
    text = "Boats float on water and carry people. " * 20
    assert client.post("/v1/documents", json={"source": "a1", "text": text}, headers=_auth(ALPHA)).status_code == 201
    r = client.post("/v1/documents", json={"source": "a2", "text": text}, headers=_auth(ALPHA))
    assert r.status_code == 413 and "cache_bytes quota of 1" in r.json()["error"]["message"]
    assert client.post("/v1/documents", json={"source": "b1", "text": text}, headers=_auth(BETA)).status_code == 201


def test_the_keys_file_sets_quotas_per_tenant(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{ALPHA} alpha requests_per_minute=60 document_bytes=10MiB\n{BETA} beta\n")
    assert load_api_keys(path) == KEYS
    quotas = load_tenant_quotas(path, TenantQuota(concurrent=4))
    assert quotas == {"alpha": TenantQuota(requests_per_minute=60, document_bytes=10 * 1024**2, concurrent=4)}
    path.write_text(f"{ALPHA} alpha slots=2\n")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        load_api_keys(path)


def test_uploads_still_indexing_count_against_the_document_quota(make_client):
    """Regression: parallel uploads each passed the check (the stored bytes grew only after indexing)."""
    from ragkv.server.state import ApiError

    client = make_client(api_keys=KEYS, tenant_quotas={"alpha": TenantQuota(document_bytes=1000)})
    state = client.app.state.ragkv
    engine = state.base.for_tenant("alpha")
    state.check_upload(engine, 600)  # admitted, indexing
    with pytest.raises(ApiError) as refused:
        state.check_upload(engine, 600)  # would pass if the first were not counted
    assert refused.value.status_code == 413
    state.upload_done(engine, 600)
    state.check_upload(engine, 600)  # the first one's bytes are released (it failed or is counted as stored)
    state.upload_done(engine, 600)
