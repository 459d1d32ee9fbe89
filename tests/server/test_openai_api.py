"""The OpenAI-compatible endpoints of a real ``ragkv serve`` process, driven by the openai client and httpx."""

from __future__ import annotations

import asyncio

import pytest

from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.model import load_model
from tests.server.conftest import APPLES

openai = pytest.importorskip("openai", reason="the openai client is in the serve extra")

QUESTIONS = [
    f"Question {i}: what is {w}?" for i, w in enumerate(["red", "blue", "tall", "far", "old", "new", "big", "wet"])
]


@pytest.fixture(scope="module")
def engine(server, tiny_model_dir):
    """An engine in this process on the server's data dir: the reference answers."""
    rag = RagKV(EngineConfig(data_dir=server.data_dir), adapter=load_model(str(tiny_model_dir)))
    yield rag
    rag.close()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat_prompt(engine: RagKV, text: str) -> str:
    return engine.adapter.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _reference(engine: RagKV, segments, n: int) -> str:
    return "".join(d for d, _ in engine.generate_segments(segments, generation=GenerationConfig(max_new_tokens=n)))


def test_models_health_and_metrics(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data]
    with server.client() as c:
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["max_batch"] >= 1
        assert health["dtype"] == "float32" and health["dtype_reason"] and health["decode_weights"] == "model"
        metrics = c.get("/metrics").text
    for name in ("ragkv_requests_total", "ragkv_ttft_seconds_bucket", "ragkv_queue_depth", "ragkv_tier_hits_total",
                 "ragkv_reused_token_ratio", "ragkv_latency_seconds_count"):  # fmt: skip
        assert name in metrics


def test_greedy_chat_without_cached_chunks_equals_plain_prefill(server, engine):
    question = "Tell me something about the weather today."
    r = _client(server).chat.completions.create(
        model="x", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content == _reference(engine, [_chat_prompt(engine, question)], 12)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens <= 12


def test_server_side_retrieval_equals_the_engine_answer(server, engine):
    question = "Where do apples grow?"
    r = _client(server).chat.completions.create(
        model="x", messages=[{"role": "user", "content": question}], max_tokens=10,
        extra_body={"ragkv": {"retrieve": True, "top_k": 1}},
    )  # fmt: skip
    info = r.model_extra["ragkv"]
    assert info["sources"] and info["sources"][0]["source"] == "mem:apples"
    texts = [s["text"] for s in info["sources"]]
    want = engine.generate_stream(texts, question, generation=GenerationConfig(max_new_tokens=10))
    assert r.choices[0].message.content == "".join(d for d, _ in want)
    assert r.usage.prompt_tokens_details.cached_tokens == info["reused_tokens"] > 0
    assert info["cache_hits"] == 1 and info["ttft_ms"] > 0 and info["bytes_loaded"] > 0


def test_client_sent_chunk_text_is_found_and_reused(server):
    client = _client(server)
    content = "Context:\n" + APPLES.strip() + "\n\nQuestion: who picks apples?"
    reuse = client.chat.completions.create(model="x", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert reuse.usage.prompt_tokens_details.cached_tokens > 0
    assert reuse.model_extra["ragkv"]["chunks_in_prompt"] == 1
    full = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": content}], max_tokens=4, extra_body={"ragkv": {"full": True}}
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.usage.prompt_tokens == reuse.usage.prompt_tokens


def test_stream_equals_blocking_answer_and_reports_usage(server):
    client = _client(server)
    kw = dict(model="x", messages=[{"role": "user", "content": "Say something."}], max_tokens=10)
    whole = client.chat.completions.create(**kw)
    parts, usage, stats = [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        stats = (chunk.model_extra or {}).get("ragkv") or stats
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert stats is not None and stats["generated_tokens"] == usage.completion_tokens


def test_eight_concurrent_streams_each_equal_the_engine_alone(server, engine):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(q: str) -> str:
        out = []
        stream = await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": q}], max_tokens=14, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        return "".join(out)

    async def all_of() -> list[str]:
        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    got = asyncio.run(all_of())
    want = [_reference(engine, [_chat_prompt(engine, q)], 14) for q in QUESTIONS]
    assert got == want


def test_completions_stop_strings_and_seeded_sampling(server, engine):
    client = _client(server)
    r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text == _reference(engine, ["Once upon a time"], 8)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="Once upon a time", max_tokens=8, stream=True))  # fmt: skip
    assert streamed == r.choices[0].text
    stop = r.choices[0].text[2:4] or "e"
    cut = client.completions.create(model="x", prompt="Once upon a time", max_tokens=8, stop=[stop])
    gen = GenerationConfig(max_new_tokens=8, stop=(stop,))
    assert cut.choices[0].text == "".join(d for d, _ in engine.generate_segments(["Once upon a time"], generation=gen))
    a, b = (client.completions.create(model="x", prompt="Hello", max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))  # fmt: skip
    assert a.choices[0].text == b.choices[0].text


def test_embeddings_are_the_engine_embedder(server, engine):
    r = _client(server).embeddings.create(model="x", input=["apples", "boats"])
    assert len(r.data) == 2 and len(r.data[0].embedding) == engine.embedder.dim
    want = engine.embedder.embed(["apples"])[0]
    assert max(abs(a - float(b)) for a, b in zip(r.data[0].embedding, want, strict=True)) < 1e-5


def test_bad_requests_are_clear_4xx_json(server):
    with server.client() as c:
        cases = [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "max_tokens"),
            ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
            ({"messages": [{"role": "user", "content": "x" * 5000}]}, "context"),
            ({"messages": [{"role": "user", "content": "hi"}], "ragkv": {"bogus": 1}}, "bogus"),
        ]
        for body, word in cases:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert word in r.json()["error"]["message"], r.text
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = c.post("/v1/completions", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        assert c.delete("/v1/documents/nope").status_code == 404


def test_documents_add_list_delete(server):
    with server.client() as c:
        r = c.post("/v1/documents", json={"source": "mem:clocks", "text": "Clocks tick with gears and springs. " * 20})
        assert r.status_code == 201 and r.json()["chunks"] >= 1
        docs = {d["source"]: d for d in c.get("/v1/documents").json()["data"]}
        assert "mem:clocks" in docs
        gone = c.delete(f"/v1/documents/{docs['mem:clocks']['id']}").json()
        assert gone["deleted"] and gone["chunks"] >= 1 and gone["cache_entries"] >= 1
        assert "mem:clocks" not in {d["source"] for d in c.get("/v1/documents").json()["data"]}
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "clocks gears springs"}],
                                                 "max_tokens": 2, "ragkv": {"retrieve": True, "top_k": 4}})  # fmt: skip
        assert all(s["source"] != "mem:clocks" for s in r.json()["ragkv"]["sources"])
        upload = c.post("/v1/documents", files={"file": ("notes.txt", b"Notes about kettles and tea. " * 20)})
        assert upload.status_code == 201 and upload.json()["sources"] == ["upload:notes.txt"]


def test_the_web_page_is_served(server):
    with server.client() as c:
        r = c.get("/")
        script = c.get("/static/app.js")  # the page's script, vendored libraries beside it
    assert r.status_code == 200 and '<script src="/static/app.js">' in r.text
    assert script.status_code == 200 and "/v1/chat/completions" in script.text


def test_the_openai_client_example_runs_against_the_server(server):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "openai_client.py"), "--url", server.url, "--max-tokens", "6"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "indexed example:honeybees" in out.stdout and "sources: example:honeybees#" in out.stdout
    assert out.stdout.count("cached_tokens") == 2


def test_langchain_chat_openai_pointed_at_the_server(server, engine):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the serve extra")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model="ragkv", temperature=0, max_tokens=8, max_retries=0
    )
    question = "Name a colour."
    msg = llm.invoke(question)
    assert msg.content == _reference(engine, [_chat_prompt(engine, question)], 8)
    assert msg.usage_metadata["output_tokens"] <= 8
    assert "".join(c.content for c in llm.stream(question)) == msg.content
