"""Item 8: fuzzed request bodies never get a 5xx and never stop the scheduler (hypothesis, in process)."""

from __future__ import annotations

import json
import weakref
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_CLIENTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # the test's fixture -> its app
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/documents"]

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | values
text = st.text(max_size=60)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | text},
    optional={"content": text | values | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}))},
)
sampling = {
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "seed": numbers,
    "stop": text | st.lists(text, max_size=3) | values,
    "stream": st.booleans() | values,
    "n": numbers,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | values,
    "ragkv": st.fixed_dictionaries(
        {}, optional={"retrieve": st.booleans(), "top_k": numbers, "full": st.booleans() | values}
    )
    | values,
    "model": text | values,
}
bodies = {
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=3) | values}, optional=sampling
    ),
    "/v1/completions": st.fixed_dictionaries({"prompt": text | st.lists(text, max_size=2) | values}, optional=sampling),
    "/v1/embeddings": st.fixed_dictionaries(
        {"input": text | st.lists(text, max_size=3) | values}, optional={"model": text | values}
    ),  # fmt: skip
    "/v1/documents": st.fixed_dictionaries(
        {"source": text | values, "text": text | values}, optional={"title": text | values}
    )  # fmt: skip
    | st.lists(st.fixed_dictionaries({"source": text, "text": text}), max_size=2),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 9)) == 0:  # now and then not JSON at all, or JSON of the wrong shape
        return route, draw(st.binary(max_size=64) | values.map(lambda v: json.dumps(v).encode()))
    return route, json.dumps(draw(bodies[route])).encode()  # NaN and Infinity included, as Python writes them


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=requests())
def test_fuzzed_bodies_get_4xx_or_success_and_the_scheduler_lives(make_client, case):
    route, body = case
    if make_client not in _CLIENTS:  # one app for every example: a fresh one each would take most of the time
        _CLIENTS[make_client] = make_client(max_tokens_limit=4)
    client = _CLIENTS[make_client]
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (route, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type"}, r.text
    assert client.app.state.ragkv.scheduler.alive
    assert client.get("/health").json()["status"] == "ok"
