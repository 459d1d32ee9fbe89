"""F1: nothing a request brings stops the scheduler thread; a dead scheduler is reported, not hung on."""

from __future__ import annotations

import queue

import pytest

from ragkv.driver import Event, Job, JobRequest
from ragkv.generation import GenerationConfig

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _job(engine, gen: GenerationConfig) -> tuple[Job, queue.Queue[Event]]:
    events: queue.Queue[Event] = queue.Queue()
    job = Job(JobRequest(engine, gen, "full", segments=["Hello there"]), post=events.put)
    return job, events


def _events(events: queue.Queue[Event]) -> list[Event]:
    out = [events.get(timeout=60)]
    while out[-1].kind not in ("done", "error"):
        out.append(events.get(timeout=60))
    return out


def test_a_seed_torch_cannot_take_fails_only_its_request(make_client):
    client = make_client()
    scheduler = client.app.state.ragkv.scheduler
    engine = client.app.state.ragkv.base
    scheduler_job, events = _job(engine, GenerationConfig(max_new_tokens=3, temperature=0.7, seed=2**64))
    scheduler.submit(scheduler_job)
    (only,) = _events(events)
    assert only.kind == "error" and "seed" in str(only.error)
    assert scheduler.alive
    ok, events = _job(engine, GenerationConfig(max_new_tokens=3, temperature=0.7, seed=2**64 - 1))
    scheduler.submit(ok)
    assert _events(events)[-1].kind == "done"


@pytest.mark.parametrize("seed", [2**64, -1, 10**30])
def test_an_out_of_range_seed_is_a_400_and_the_server_keeps_answering(make_client, seed):
    client = make_client()
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7, "seed": seed})
    assert r.status_code == 400, r.text
    assert "seed" in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7, "seed": 5}).status_code == 200
    assert client.get("/health").json()["status"] == "ok"


def test_a_dead_scheduler_shows_in_health_and_requests_fail_fast(make_client):
    client = make_client()
    scheduler = client.app.state.ragkv.scheduler

    def boom() -> None:
        raise SystemExit("simulated bug in the scheduler loop")

    scheduler._drop_cancelled = boom  # the loop itself fails (not a request), as F1's seed once did
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503, r.text
    assert "scheduler" in r.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert "simulated bug" in health.json()["scheduler"]
    again = client.post("/v1/chat/completions", json=CHAT)  # refused at once: nothing left to wait on
    assert again.status_code == 503 and "restart the server" in again.json()["error"]["message"]


def test_a_row_whose_pick_fails_ends_alone_and_its_batch_mates_finish(make_client, monkeypatch):
    """One request's bad sampling (its own settings) fails that request, not every row decoding with it."""
    import ragkv.driver.scheduler as sched

    client = make_client()
    scheduler = client.app.state.ragkv.scheduler
    engine = client.app.state.ragkv.base
    real = sched.pick_token
    calls = {"n": 0}

    def flaky(logits, gen, rng):
        if gen.top_k == 7:  # the poisoned request: its second pick (inside a batched step) raises
            calls["n"] += 1
            if calls["n"] >= 2:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, gen, rng)

    monkeypatch.setattr(sched, "pick_token", flaky)
    bad, bad_events = _job(engine, GenerationConfig(max_new_tokens=6, temperature=0.7, top_k=7, seed=1))
    good, good_events = _job(engine, GenerationConfig(max_new_tokens=6))
    scheduler.submit(bad)
    scheduler.submit(good)
    assert _events(bad_events)[-1].kind == "error"
    assert _events(good_events)[-1].kind == "done"
    assert scheduler.alive
