"""Item 2: a tenant's engine is made off the event loop; the scheduler needs only the ServedEngine protocol."""

from __future__ import annotations

import threading

from ragkv.engine import RagKV

ALPHA, BETA = "sk-loop-alpha-01", "sk-loop-beta-002"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_slow_tenant_start_delays_neither_health_nor_another_tenant(make_client):
    client = make_client(api_keys={ALPHA: "alpha", BETA: "beta"})
    base = client.app.state.ragkv.base
    make = base.for_tenant
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_for_tenant(tenant: str) -> RagKV:
        if tenant == "beta":  # beta's catalog and FAISS file are slow to open
            entered.set()
            gate.wait(60)
            finished.set()
        return make(tenant)

    base.for_tenant = slow_for_tenant
    answers: dict[str, int] = {}

    def beta_asks() -> None:
        r = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {BETA}"})
        answers["beta"] = r.status_code

    beta = threading.Thread(target=beta_asks)
    beta.start()
    assert entered.wait(60)
    try:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {ALPHA}"})
        assert r.status_code == 200
        assert not finished.is_set()  # both answered while beta's engine was still being made
    finally:
        gate.set()
        beta.join(60)
    assert answers == {"beta": 200}


def test_every_tenant_engine_shares_the_models_lock(make_client):
    engine = make_client().app.state.ragkv.base
    assert engine.model_lock is engine.for_tenant("other").model_lock  # one model: one forward pass at a time
