"""What the Serve ingress keeps for the cluster: quotas, document turns, merged metrics, and how it
survives a replica that fails (stand-in engine handles that inject the faults; no Ray cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from ragkv.replicas.gate import ClusterGate, MetricsBoard
from ragkv.server.metrics import Metrics
from ragkv.server.quotas import QuotaError, TenantQuota
from ragkv.server.settings import ServerSettings
from ragkv.types import GenerationStats

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}


def gate(**quota: Any) -> ClusterGate:
    return ClusterGate(ServerSettings(api_keys=KEYS, quota=TenantQuota(**quota)), "default")


def test_the_rate_quota_counts_every_replicas_requests_once():
    g = gate(requests_per_minute=3)
    for _ in range(3):
        g.admit("GET", "/v1/models", "Bearer sk-alpha")
    with pytest.raises(QuotaError) as e:
        g.admit("POST", "/v1/chat/completions", "Bearer sk-alpha")
    assert e.value.status == 429 and e.value.retry_after == 60 and "requests_per_minute" in str(e.value)
    g.admit("GET", "/v1/models", "Bearer sk-beta")  # another tenant is untouched
    for path in ("/health", "/metrics", "/", "/static/app.js"):  # no quota outside /v1, as in ragkv serve
        assert g.admit("GET", path, "Bearer sk-alpha").tenant is None
    assert g.admit("GET", "/v1/models", "Bearer sk-unknown").tenant is None  # the replica answers 401


def test_a_generation_slot_is_held_until_released_once():
    g = gate(concurrent=1)
    first = g.admit("POST", "/v1/chat/completions", "Bearer sk-alpha")
    assert first.generation
    with pytest.raises(QuotaError) as e:
        g.admit("POST", "/v1/completions", "Bearer sk-alpha")
    assert e.value.status == 429 and e.value.retry_after == 1
    assert not g.admit("GET", "/v1/documents", "Bearer sk-alpha").generation  # not a generation
    g.release(first)
    g.release(first)  # a second release frees nothing more
    assert g.quotas.running("alpha") == 0
    g.release(g.admit("POST", "/v1/chat/completions", "Bearer sk-alpha"))


def test_generations_past_what_the_replicas_hold_are_429():
    g = ClusterGate(ServerSettings(api_keys=KEYS), "default", capacity=2)
    held = [g.admit("POST", "/v1/chat/completions", f"Bearer {k}") for k in ("sk-alpha", "sk-beta")]
    with pytest.raises(QuotaError) as e:
        g.admit("POST", "/v1/completions", "Bearer sk-alpha")
    assert e.value.status == 429 and e.value.retry_after == 1 and "retry shortly" in str(e.value)
    g.admit("GET", "/v1/documents", "Bearer sk-alpha")  # not a generation: still served
    g.release(held[0])
    g.release(g.admit("POST", "/v1/completions", "Bearer sk-alpha"))
    assert g.generations == 1


def test_without_keys_every_request_is_the_servers_own_tenant():
    g = ClusterGate(ServerSettings(quota=TenantQuota(requests_per_minute=1)), "default")
    assert g.admit("GET", "/v1/models", "").tenant == "default"
    with pytest.raises(QuotaError):
        g.admit("GET", "/v1/models", "Bearer anything")


def test_document_changes_take_turns_per_tenant():
    g = gate()
    upload = g.document_turn("POST", "/v1/documents", "alpha")
    assert upload is not None and upload is g.document_turn("DELETE", "/v1/documents/7", "alpha")
    assert g.document_turn("POST", "/v1/documents", "beta") is not upload
    assert g.document_turn("GET", "/v1/documents", "alpha") is None
    assert g.document_turn("POST", "/v1/chat/completions", "alpha") is None


def replica_metrics(requests: int, ttft_s: float) -> str:
    m = Metrics()
    for _ in range(requests):
        m.count_request("/v1/chat/completions", 200)
    m.observe_generation(GenerationStats(ttft_ms=ttft_s * 1000, total_ms=ttft_s * 2000, prompt_tokens=10), "stop")
    return m.render((0, 0), {"memory": (3, 1, 0)}, 5)


def parse(text: str) -> tuple[dict[str, list[str]], dict[str, float]]:
    """HELP/TYPE lines per family and sample -> value, checking each family's header comes once."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# "):
            headers.setdefault(line.split()[2], []).append(line.split()[1])
        else:
            name, value = line.rsplit(" ", 1)
            assert name not in samples, f"sample {name} twice"
            samples[name] = float(value)
    assert all(kinds == ["HELP", "TYPE"] for kinds in headers.values()), headers
    return headers, samples


def test_the_board_labels_each_replicas_samples_and_forgets_the_silent():
    board = MetricsBoard(max_age_s=10)
    board.report("r1", replica_metrics(2, 0.2), now=0.0)
    board.report("r2", replica_metrics(3, 7.0), now=5.0)
    headers, samples = parse(board.render(now=6.0))
    one = parse(replica_metrics(1, 0.1))[0]
    assert set(headers) == set(one) | {"ragkv_replicas_reporting"}  # every family once
    assert samples['ragkv_requests_total{replica="r1",endpoint="/v1/chat/completions",status="200"}'] == 2
    assert samples['ragkv_requests_total{replica="r2",endpoint="/v1/chat/completions",status="200"}'] == 3
    assert samples['ragkv_ttft_seconds_bucket{replica="r2",le="10.0"}'] == 1
    assert samples['ragkv_decode_steps_total{replica="r1"}'] == 5
    assert samples["ragkv_replicas_reporting"] == 2
    _, later = parse(board.render(now=12.0))  # r1 silent for 12 s: dropped
    assert later["ragkv_replicas_reporting"] == 1 and not any('replica="r1"' in k for k in later)


def _health(status: str, waiting: int, tokens: int, outside_s: float) -> dict[str, Any]:
    decode = {"steps": tokens, "carried_steps": 0, "tokens": tokens, "outside_s": outside_s, "forward_s": 1.0}
    return {"status": status, "waiting": waiting, "decoding": 1, "decode": decode, "model": "m"}


def test_the_board_answers_the_clusters_health_from_every_fresh_replica():
    board = MetricsBoard(max_age_s=10)
    assert board.health(now=0.0) is None  # nothing reported yet: the ingress forwards to one replica
    board.report("r1", replica_metrics(1, 0.1), _health("ok", 2, 100, 0.5), now=0.0)
    board.report("r2", replica_metrics(1, 0.1), _health("unavailable", 1, 300, 1.5), now=5.0)
    both = board.health(now=6.0)
    assert both is not None and both["status"] == "ok"  # one replica serves: the ingress routes there
    assert (both["replicas_reporting"], both["replicas_ok"], both["waiting"], both["decoding"]) == (2, 1, 3, 2)
    assert both["decode"]["tokens"] == 400 and both["decode"]["outside_ms_per_token"] == 5.0  # 2 s / 400
    assert both["replicas"]["r2"]["status"] == "unavailable"  # each replica's own body
    later = board.health(now=12.0)  # r1 silent for 12 s: dropped, and the one left is down
    assert later is not None and later["status"] == "unavailable" and set(later["replicas"]) == {"r2"}


# ---- the ingress, on stand-in engine handles ---------------------------------------------------


class Call:
    """What ``handle.options(...).remote(...)`` returns: awaitable (hint) and async-iterable (forward)."""

    def __init__(self, messages: list[Any], fail_at: int | None) -> None:
        self.messages, self.fail_at, self.i = messages, fail_at, 0

    def __await__(self) -> Any:
        async def value() -> Any:
            return []

        return value().__await__()

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        if self.i == self.fail_at:
            raise RuntimeError("the replica's actor died")
        if self.i >= len(self.messages):
            raise StopAsyncIteration
        self.i += 1
        return self.messages[self.i - 1]


class Engine:
    """A handle whose replicas fail as scripted: ``fail_at[n]`` is where the n-th forward call fails."""

    def __init__(self, messages: list[Any], fail_at: list[int | None]) -> None:
        self.messages, self.fail_at, self.calls = messages, list(fail_at), 0
        self._method = ""

    def options(self, method_name: str, **_: Any) -> Engine:
        self._method = method_name
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Call:
        if self._method != "forward":
            return Call([], None)
        fail = self.fail_at[self.calls] if self.calls < len(self.fail_at) else None
        self.calls += 1
        return Call(self.messages, fail)


SSE = [
    {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
    {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True},
    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False},
]


def make_ingress(engine: Engine, **quota: Any) -> Any:
    pytest.importorskip("ray.serve")
    from ragkv.replicas.app import Ingress, ReplicaOptions

    return Ingress(engine, ServerSettings(quota=TenantQuota(**quota)), "default", ReplicaOptions())


def send(ingress: Any, method: str = "POST", path: str = "/v1/chat/completions") -> tuple[int, bytes, Any]:
    """One request through ``ingress``: (status, whole body, headers)."""
    from starlette.requests import Request

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()

    async def run() -> tuple[int, bytes, Any]:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
        response = await ingress(Request(scope, receive))
        chunks = [c async for c in response.body_iterator] if hasattr(response, "body_iterator") else [response.body]
        return response.status_code, b"".join(chunks), response.headers

    return asyncio.run(run())


def call_ingress(engine: Engine, path: str = "/v1/chat/completions", **quota: Any) -> tuple[int, bytes, Any]:
    """One chat request through a new Ingress on ``engine``: (status, body, the ingress)."""
    ingress = make_ingress(engine, **quota)
    status, body, _ = send(ingress, "POST", path)
    return status, body, ingress


def test_the_ingress_answers_health_for_the_cluster_once_replicas_report():
    ingress = make_ingress(Engine(SSE, []))
    status, body, _ = send(ingress, "GET", "/health")
    assert status == 200 and ingress._engine.calls == 1  # no report yet: one replica's, forwarded
    ingress.report_metrics("r1", replica_metrics(1, 0.1), _health("ok", 0, 10, 0.1))
    ingress.report_metrics("r2", replica_metrics(1, 0.1), _health("ok", 2, 30, 0.3))
    status, body, _ = send(ingress, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and ingress._engine.calls == 1  # answered by the ingress itself
    assert health["replicas_reporting"] == 2 and health["decode"]["tokens"] == 40 and health["waiting"] == 2
    ingress.report_metrics("r1", replica_metrics(1, 0.1), _health("unavailable", 0, 10, 0.1))
    ingress.report_metrics("r2", replica_metrics(1, 0.1), _health("unavailable", 0, 30, 0.3))
    assert send(ingress, "GET", "/health")[0] == 503  # no replica can serve


def test_a_replica_that_fails_before_answering_costs_a_retry_not_an_error():
    engine = Engine(SSE, fail_at=[0, 0])  # two replicas fail at once; the third answers
    status, body, _ = call_ingress(engine)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n") and engine.calls == 3


def test_a_replica_that_keeps_failing_is_a_503_that_says_retry_and_frees_the_slot():
    engine = Engine(SSE, fail_at=[0, 0, 0])
    status, body, ingress = call_ingress(engine, concurrent=1)
    assert status == 503 and "retry" in json.loads(body)["error"]["message"]
    assert ingress._gate.quotas.running("default") == 0


def test_a_replica_that_fails_mid_stream_ends_it_with_an_error_event():
    engine = Engine(SSE, fail_at=[2])  # the start and one event, then the replica dies
    status, body, ingress = call_ingress(engine, concurrent=1)
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: {")]
    assert status == 200 and events[0] == {"x": 1} and events[-1]["error"]["type"] == "server_error"
    assert b"[DONE]" not in body and engine.calls == 1  # an answer half sent is not sent again
    assert ingress._gate.quotas.running("default") == 0


def test_a_document_upload_is_not_retried():
    engine = Engine(SSE, fail_at=[0, None])
    status, _, _ = call_ingress(engine, path="/v1/documents")
    assert status == 503 and engine.calls == 1


def test_the_ingress_answers_429_over_the_clusters_quota():
    ingress = make_ingress(Engine(SSE, fail_at=[]), requests_per_minute=1)
    assert send(ingress)[0] == 200
    status, body, headers = send(ingress, "GET", "/v1/models")  # a second request in the minute
    assert status == 429 and headers["retry-after"] == "60"
    assert "requests_per_minute" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/documents"])
def test_a_response_whose_client_is_gone_before_its_body_frees_its_slot_and_turn(path):
    from starlette.requests import Request

    ingress = make_ingress(Engine(SSE, fail_at=[]), concurrent=1)
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}

    sent: list[bool] = []

    async def receive() -> dict[str, Any]:  # the body, then the client is gone
        if sent:
            return {"type": "http.disconnect"}
        sent.append(True)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def gone(message: dict[str, Any]) -> None:
        raise OSError("the client closed the connection")

    async def run() -> None:
        response = await ingress(Request(scope, receive))
        with contextlib.suppress(OSError):  # as the server sees a client gone mid-send
            await response(scope, receive, gone)  # the body iterator is never started

    asyncio.run(run())
    assert ingress._gate.quotas.running("default") == 0 and ingress._gate.generations == 0
    turn = ingress._gate.document_turn("POST", "/v1/documents", "default")
    assert turn is not None and not turn.locked()
    assert send(ingress, "POST", path)[0] == 200  # the next one is admitted


def test_an_upload_cancelled_while_it_waits_for_its_turn_leaves_the_holders_turn_alone():
    from starlette.requests import Request

    ingress = make_ingress(Engine(SSE, fail_at=[]))
    turn = ingress._gate.document_turn("POST", "/v1/documents", "default")
    scope = {"type": "http", "method": "POST", "path": "/v1/documents", "headers": [], "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def run() -> None:
        await turn.acquire()  # another upload of the tenant runs
        waiting = asyncio.ensure_future(ingress(Request(scope, receive)))
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client left while waiting
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert turn.locked()  # still the running upload's

    asyncio.run(run())


@pytest.mark.parametrize("router", ["affinity", "power_of_two", "round_robin"])
def test_each_router_is_serves_own_default_or_a_public_class(router):
    """The power-of-two baseline is Serve's default router, named by Serve (its class lives in a
    private module); ragkv's routers are named by their import path."""
    from ray.serve.config import RequestRouterConfig

    from ragkv.replicas.app import ROUTERS, ReplicaOptions, router_config

    config = router_config(ReplicaOptions(router=router, stats_period_s=1.0))
    assert config.request_router_class == (ROUTERS[router] or RequestRouterConfig().request_router_class)
    assert config.request_routing_stats_period_s == 1.0
    assert bool(config.request_router_kwargs) == (router == "affinity")  # the affinity router's knobs
    assert all("_private" not in path for path in ROUTERS.values() if path)
