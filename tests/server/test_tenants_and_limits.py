"""API keys, tenants and the queue limit on a real ``ragkv serve`` process (--max-batch 1 --max-queue 1)."""

from __future__ import annotations

import json
import time

import httpx

from tests.server.conftest import APPLES, BOATS, KEYS, only_one_process

ALPHA, BETA = list(KEYS)


def test_requests_need_a_known_key(keyed_server):
    for headers in ({}, {"Authorization": "Bearer sk-not-a-real-key"}, {"Authorization": "Basic abc"}):
        with httpx.Client(base_url=keyed_server.url, headers=headers, timeout=60) as c:
            for method, path in (("GET", "/v1/models"), ("GET", "/v1/documents"), ("POST", "/v1/chat/completions")):
                r = c.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 401, (headers, path, r.text)
                assert "API key" in r.json()["error"]["message"]


def test_tenants_never_see_each_others_documents(keyed_server):
    with keyed_server.client(ALPHA) as a, keyed_server.client(BETA) as b:
        assert a.post("/v1/documents", json={"source": "mem:apples", "text": APPLES}).status_code == 201
        assert b.post("/v1/documents", json={"source": "mem:boats", "text": BOATS}).status_code == 201
        mine = {d["source"]: d["id"] for d in a.get("/v1/documents").json()["data"]}
        theirs = {d["source"]: d["id"] for d in b.get("/v1/documents").json()["data"]}
        assert set(mine) == {"mem:apples"} and set(theirs) == {"mem:boats"}
        ask = {"messages": [{"role": "user", "content": "apples orchards"}], "max_tokens": 2,
               "ragkv": {"retrieve": True, "top_k": 4}}  # fmt: skip
        assert {s["source"] for s in b.post("/v1/chat/completions", json=ask).json()["ragkv"]["sources"]} == {
            "mem:boats"
        }
        assert {s["source"] for s in a.post("/v1/chat/completions", json=ask).json()["ragkv"]["sources"]} == {
            "mem:apples"
        }
        # beta's prompt holding alpha's chunk text verbatim reuses nothing of alpha's
        sent = {"messages": [{"role": "user", "content": APPLES.strip() + "\n\nWho picks?"}], "max_tokens": 2}
        assert b.post("/v1/chat/completions", json=sent).json()["ragkv"].get("chunks_in_prompt") == 0
        assert a.post("/v1/chat/completions", json=sent).json()["ragkv"]["chunks_in_prompt"] == 1
        assert b.delete(f"/v1/documents/{mine['mem:apples']}").status_code == 404
        assert b.delete("/v1/documents/mem:apples").status_code == 404
        assert "mem:apples" in {d["source"] for d in a.get("/v1/documents").json()["data"]}


def _wait_idle(c: httpx.Client, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = c.get("/health").json()
        if health["waiting"] == 0 and health["decoding"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the server still holds requests: {health}")


@only_one_process  # with replicas the limit is replicas x (max_batch + max_queue): test_replica_gate.py
def test_queue_limit_gives_429_and_a_disconnect_frees_the_slot(keyed_server):
    long = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 2000, "stream": True}
    with keyed_server.client(ALPHA) as c:
        _wait_idle(c)
        with (
            httpx.Client(base_url=keyed_server.url, headers={"Authorization": f"Bearer {ALPHA}"}, timeout=60) as s,
            s.stream("POST", "/v1/chat/completions", json=long) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "chat.completion.chunk"
            busy = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert busy.status_code == 429 and busy.headers["retry-after"]
            assert "queued" in busy.json()["error"]["message"]
            assert c.get("/health").json()["decoding"] == 1
        # the stream was closed mid-answer: its slot is free long before 2000 tokens
        _wait_idle(c)
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert ok.status_code == 200
        metrics = c.get("/metrics").text
        assert 'ragkv_generations_total{reason="cancelled"}' in metrics
        assert 'status="429"' in metrics
