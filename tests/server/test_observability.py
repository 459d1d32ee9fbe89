"""/metrics access and labels (F2), the access log and /health wording (F10), embeddings bounds (F6),
and a blocking client that leaves (F3)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import pytest

KEY = "sk-observe-alpha-1"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_metrics_need_a_key_when_keys_are_configured(make_client):
    client = make_client(api_keys={KEY: "alpha"}, metrics_key="metrics-token-1")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong-key-123"}).status_code == 401
    for key in (KEY, "metrics-token-1"):
        r = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and "ragkv_requests_total" in r.text
    assert make_client().get("/metrics").status_code == 200  # no keys: loopback-only, open as before


def test_metrics_labels_come_from_route_templates_only(make_client):
    client = make_client()
    for _ in range(50):
        assert client.get(f"/no/such/{uuid.uuid4().hex}").status_code == 404
    client.delete(f"/v1/documents/{uuid.uuid4().hex}")
    text = client.get("/metrics").text
    endpoints = {line.split('endpoint="')[1].split('"')[0] for line in text.splitlines() if 'endpoint="' in line}
    assert endpoints == {"unmatched", "/v1/documents/{doc_id}"}
    assert 'ragkv_requests_total{endpoint="unmatched",status="404"} 50' in text


def test_one_access_log_line_per_request_and_never_a_key(make_client, caplog):
    client = make_client(api_keys={KEY: "alpha"})
    auth = {"Authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.INFO, logger="ragkv.server.access"):
        assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        assert client.delete("/v1/documents/nothing-here", headers=auth).status_code == 404
        assert client.get("/v1/models").status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "ragkv.server.access"]
    assert len(lines) == 3, lines
    chat, missing, refused = lines
    assert chat.startswith("method=POST route=/v1/chat/completions status=200 duration_ms=")
    assert "tenant=alpha" in chat and "cached_tokens=0" in chat
    assert "route=/v1/documents/{doc_id} status=404" in missing and "tenant=alpha" in missing
    assert "status=401" in refused and "tenant=-" in refused
    assert all(KEY not in line for line in lines)


def test_access_log_as_json(make_client, caplog):
    client = make_client(log_json=True)
    with caplog.at_level(logging.INFO, logger="ragkv.server.access"):
        client.post("/v1/chat/completions", json=CHAT)
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "ragkv.server.access"]
    assert line["method"] == "POST" and line["route"] == "/v1/chat/completions" and line["status"] == 200
    assert line["tenant"] == "default" and line["cached_tokens"] == 0 and line["duration_ms"] >= 0


def test_health_names_tiers_in_plain_words(make_client):
    tiers = make_client().get("/health").json()["tiers"]
    assert tiers and set(tiers.values()) == {"reachable"}


def test_health_shows_the_decoded_chunk_tiers_only_where_the_engine_has_them(make_client):
    from ragkv.gpu import DeviceTierConfig, HostTierConfig

    assert not {"device_tier", "host_tier"} & set(make_client().get("/health").json())  # a CPU model: none
    tiers = {"device_tier": DeviceTierConfig(budget_bytes=1 << 20), "host_tier": HostTierConfig(budget_bytes=2 << 20)}
    body = make_client(engine=tiers).get("/health").json()
    assert body["device_tier"]["budget_bytes"] == 1 << 20 and body["host_tier"]["budget_bytes"] == 2 << 20
    assert {"entries", "bytes", "hits", "misses", "evictions", "queued", "dropped"} <= set(body["host_tier"])


def test_embeddings_are_bounded(make_client):
    client = make_client(max_embedding_inputs=4, max_embedding_chars=100)
    ok = client.post("/v1/embeddings", json={"input": ["apples", "boats"]})
    assert ok.status_code == 200 and [d["index"] for d in ok.json()["data"]] == [0, 1]
    many = client.post("/v1/embeddings", json={"input": ["x"] * 5})
    assert many.status_code == 413 and "max_embedding_inputs" in many.json()["error"]["message"]
    long = client.post("/v1/embeddings", json={"input": ["y" * 101]})
    assert long.status_code == 413 and "max_embedding_chars" in long.json()["error"]["message"]


def test_a_blocking_client_that_leaves_frees_its_slot(make_client):
    client = make_client()
    state = client.app.state.ragkv
    body = json.dumps({"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 2000})

    async def leave_once_decoding() -> list[dict]:
        sent: list[dict] = []
        gave_body = False

        async def receive() -> dict:
            nonlocal gave_body
            if not gave_body:
                gave_body = True
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            while state.scheduler.depth[1] == 0:  # the client leaves once its answer is being decoded
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
                 "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}  # fmt: skip
        await client.app(scope, receive, send)
        return sent

    sent = asyncio.run(leave_once_decoding())
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    for _ in range(3000):  # the scheduler drops the row at its next turn
        if state.scheduler.depth == (0, 0):
            break
        time.sleep(0.01)
    assert state.scheduler.depth == (0, 0)
    assert state.metrics.finished["cancelled"] == 1, state.metrics.finished
    assert state.metrics.finished["length"] == 0  # it did not run on to max_tokens


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_streaming_and_blocking_answers_record_cached_tokens(make_client, caplog, route):
    client = make_client()
    body = CHAT if "chat" in route else {"prompt": "hi", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="ragkv.server.access"):
        client.post(route, json={**body, "stream": True})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ragkv.server.access"]
    assert f"route={route} status=200" in line and "cached_tokens=0" in line
