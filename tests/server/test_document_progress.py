"""POST /v1/documents?stream=true on a real server: progress events per phase, then the report."""

from __future__ import annotations

import json
import time

import httpx

TOPICS = ["glaciers", "volcanoes", "deserts", "rainforests", "coral reefs", "tundra", "savannas", "wetlands"]
LONG = "\n\n".join(
    f"{t.capitalize()} are studied by scientists who measure how {t} change over the seasons and the years. " * 12
    for t in TOPICS
)


PHASES = ("chunking", "precompute", "embedding")


def _events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _sources(client: httpx.Client) -> set[str]:
    return {d["source"] for d in client.get("/v1/documents").json()["data"]}


def test_streamed_indexing_reports_each_phase_then_the_report(server):
    doc = {"source": "mem:earth", "text": LONG}
    with server.client() as c:
        with c.stream("POST", "/v1/documents?stream=true", json=doc) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = _events(r)
        *progress, final = events
        assert {e["object"] for e in progress} == {"document.progress"}
        by_phase = {p: [(e["done"], e["total"]) for e in progress if e["phase"] == p] for p in PHASES}
        chunks = final["chunks"]
        assert chunks > 1  # a document of several chunks, so precompute has several steps
        assert by_phase["chunking"] == [(1, 1)]
        assert by_phase["precompute"] == [(i, final["computed"]) for i in range(final["computed"] + 1)]
        assert by_phase["embedding"] == [(1, 1)]
        assert final["object"] == "document.index" and final["status"] == 201 and final["sources"] == ["mem:earth"]

        # the same upload blocking (the default) answers the same report, now with nothing to redo
        again = c.post("/v1/documents", json=doc)
        assert again.status_code == 201 and again.json()["unchanged"] == 1
        # Accept: text/event-stream asks for the stream too; an unchanged document has no step to report
        with c.stream("POST", "/v1/documents", json=doc, headers={"Accept": "text/event-stream"}) as r:
            assert [e.get("object") for e in _events(r)] == ["document.index"]
        assert c.delete("/v1/documents/mem:earth").status_code == 200


def test_bad_input_is_a_400_before_any_stream(server):
    with server.client() as c:
        r = c.post("/v1/documents?stream=true", json={"source": "mem:x", "text": "  "})
        assert r.status_code == 400 and "non-empty 'text'" in r.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_does_not_stop_the_indexing(server):
    doc = {"source": "mem:earth-left", "text": LONG.replace("scientists", "researchers")}
    with server.client() as c:
        with c.stream("POST", "/v1/documents?stream=true", json=doc) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["object"] == "document.progress"
        deadline = time.monotonic() + 120
        while "mem:earth-left" not in _sources(c):
            assert time.monotonic() < deadline, "the document was not indexed after its client left"
            time.sleep(0.2)
        chunks = {d["source"]: d["chunks"] for d in c.get("/v1/documents").json()["data"]}["mem:earth-left"]
        assert chunks > 1
        assert c.delete("/v1/documents/mem:earth-left").status_code == 200
