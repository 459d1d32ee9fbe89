"""Bad bodies, hosts, origins and content types are refused before any handler runs (F5, F8)."""

from __future__ import annotations

import pytest

from ragkv.server.guard import json_depth

DOC = {"source": "mem:apples", "text": "Apples grow on trees in orchards. " * 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_json_depth_matches_the_nesting_json_sees():
    import json

    cases = [r'{"a": [1, {"b": "[[[["}]}', r'["\"[[", [[]]]', "[]", '"x"', r'{"a": {"b": {"c": []}}}']
    for body in cases:

        def depth(v) -> int:
            if isinstance(v, list):
                return 1 + max((depth(x) for x in v), default=0)
            if isinstance(v, dict):
                return 1 + max((depth(x) for x in v.values()), default=0)
            return 0

        assert json_depth(body.encode()) == depth(json.loads(body)), body


@pytest.mark.parametrize("path", ["/v1/documents", "/v1/chat/completions", "/v1/embeddings"])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(make_client, path):
    client = make_client()
    body = '{"source": "mem:x", "text": "t", "title": ' + _deep(50_000) + "}"
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested 50001 levels deep" in r.json()["error"]["message"]
    assert client.get("/health").json()["status"] == "ok"


def test_a_title_that_is_not_a_string_is_refused(make_client):
    r = make_client().post("/v1/documents", json={**DOC, "title": [[["a"]]]})
    assert r.status_code == 400 and "title" in r.json()["error"]["message"]


def test_json_bodies_over_their_route_limit_are_413(make_client):
    client = make_client(max_json_bytes=4096, max_body_bytes=64 * 1024)
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert client.post("/v1/documents", json={**DOC, "text": "y " * 3000}).status_code == 201  # its own limit
    r = client.post("/v1/documents", json={**DOC, "text": "y " * 40_000})
    assert r.status_code == 413


@pytest.mark.parametrize("field", ["source", "title"])
def test_nul_bytes_in_document_names_are_refused(make_client, field):
    client = make_client()
    r = client.post("/v1/documents", json={**DOC, field: "mem:ap\x00ples"})
    assert r.status_code == 400 and "NUL" in r.json()["error"]["message"]
    assert client.get("/v1/documents").json()["data"] == []


def test_nul_bytes_in_an_uploaded_file_name_are_refused(make_client):
    client = make_client()
    body = (b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="notes\x00.txt"\r\n'
            b"Content-Type: text/plain\r\n\r\n" + b"Some notes about apples. " * 4 + b"\r\n--XyZ--\r\n")  # fmt: skip
    r = client.post("/v1/documents", content=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"})
    assert r.status_code == 400 and "NUL" in r.json()["error"]["message"]
    ok = client.post("/v1/documents", files={"file": ("notes.txt", b"Some notes about apples. " * 4, "text/plain")})
    assert ok.status_code == 201, ok.text


def test_a_foreign_host_header_is_421(make_client):
    client = make_client()
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = client.get("/v1/models", headers={"Host": host})
        assert r.status_code == 421, host
        assert "--allowed-host" in r.json()["error"]["message"]
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    named = make_client(allowed_hosts=("ragkv.internal",))
    assert named.get("/v1/models", headers={"Host": "ragkv.internal:8000"}).status_code == 200
    assert make_client(allowed_hosts=("*",)).get("/health", headers={"Host": "any.where"}).status_code == 200


def test_json_sent_as_another_content_type_is_415(make_client):
    client = make_client()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = client.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers)
        assert r.status_code == 415, ctype
        assert "application/json" in r.json()["error"]["message"]
    r = client.post("/v1/documents", content=b'{"source": "a", "text": "b"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert client.get("/v1/documents").json()["data"] == []


def test_a_foreign_origin_cannot_change_state_without_keys(make_client):
    client = make_client()
    evil = {"Origin": "http://evil.example"}
    assert client.post("/v1/documents", json=DOC, headers=evil).status_code == 403
    files = {"file": ("a.txt", b"Apples in orchards. " * 4, "text/plain")}
    assert client.post("/v1/documents", files=files, headers=evil).status_code == 403
    assert client.post("/v1/chat/completions", json=CHAT, headers=evil).status_code == 403
    assert client.delete("/v1/documents/x", headers=evil).status_code == 403
    assert client.get("/v1/documents").json()["data"] == []
    # the page itself (same origin), and clients that send no Origin, are served
    same = {"Origin": "http://127.0.0.1"}
    assert client.post("/v1/documents", json=DOC, headers=same).status_code == 201
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_with_api_keys_the_key_decides_not_the_origin(make_client):
    client = make_client(api_keys={"sk-origin-test-01": "alpha"})
    headers = {"Origin": "http://elsewhere.example", "Authorization": "Bearer sk-origin-test-01"}
    assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200


def test_with_keys_a_body_is_not_read_for_a_client_without_one(make_client, monkeypatch):
    """Regression: the guard read (and held) up to 8 MiB of body before any key was checked."""
    import ragkv.server.guard as guard

    reads = []
    real = guard._read

    async def counted(receive, limit):
        reads.append(limit)
        return await real(receive, limit)

    monkeypatch.setattr(guard, "_read", counted)
    client = make_client(api_keys={"sk-guard-test-0001": "alpha"})
    r = client.post("/v1/documents", json={"source": "mem:x", "text": "y" * 1000})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = client.post("/v1/documents", headers={"Authorization": "Bearer nope"}, json={"source": "mem:x", "text": "y"})
    assert r.status_code == 401 and reads == []
