"""LlamaIndex's OpenAI-like LLM pointed at a real server: the docs/serving.md snippet, run as written there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server.conftest import APPLES, BOATS

pytest.importorskip("llama_index.llms.openai_like", reason="llama-index-llms-openai-like is in the dev extra")
openai = pytest.importorskip("openai", reason="the openai client is in the serve extra")

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
MARK = "<!-- tested: tests/server/test_llamaindex_client.py -->"


def snippet() -> str:
    """The python block right after the marker in docs/serving.md."""
    block = re.escape(MARK) + r"\n(?:<!--[^\n]*-->\n)*```python\n(.*?)\n```"  # other markers may sit between
    found = re.search(block, DOC.read_text(encoding="utf-8"), re.S)
    assert found, f"docs/serving.md lost its tested LlamaIndex block (the line {MARK} before a python block)"
    return found.group(1)


def test_the_documented_llamaindex_snippet_runs_against_the_server(server, capsys):
    code = snippet().replace("http://127.0.0.1:8000", server.url)
    # the page's placeholder texts give way to the chunks this server indexed
    code, placeholders = re.subn(r"^retrieved_texts = .*$", "", code, flags=re.M)
    assert placeholders == 1, "the snippet should define retrieved_texts once (the retriever's output)"
    scope: dict = {"retrieved_texts": [APPLES.strip(), BOATS.strip()]}  # chunks the server indexed, stripped
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "| cached tokens:" in out[0] and "'mem:apples'" in out[1]

    # way 1: the pasted chunk was found and its cache reused; the answer is the openai client's for that prompt
    answer, client = scope["answer"], openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert answer.raw.usage.prompt_tokens_details.cached_tokens > 0
    info = answer.raw.model_extra["ragkv"]
    assert info["chunks_in_prompt"] == 2 and info["cache_hits"] == 2 and info["cache_misses"] == 0
    prompt = scope["prompt"] + f"Answer the query.\nQuery: {scope['question']}\nAnswer: "
    same = client.chat.completions.create(
        model="ragkv", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0
    )
    assert answer.text == same.choices[0].message.content

    # way 2: server-side retrieval through additional_kwargs, sources in the raw response
    reply = scope["reply"]
    info = reply.raw.model_extra["ragkv"]
    assert info["sources"][0]["source"] == "mem:apples" and info["cache_hits"] >= 1
    same = client.chat.completions.create(
        model="ragkv", messages=[{"role": "user", "content": scope["question"]}], max_tokens=32, temperature=0,
        extra_body={"ragkv": {"retrieve": True, "top_k": 2}},
    )  # fmt: skip
    assert reply.message.content == same.choices[0].message.content
