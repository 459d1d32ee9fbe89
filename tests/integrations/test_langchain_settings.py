"""LangChain: standard settings honoured or refused, the engine positionally, the real model name."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("langchain_core")

from ragkv.integrations import _bridge  # noqa: E402
from ragkv.integrations.langchain import ChatRagKV, RagKVLLM, RagKVRetriever  # noqa: E402


def test_engine_positionally_and_max_tokens_bounds_the_answer(rag):
    chat = ChatRagKV(rag, max_tokens=2)
    msg = chat.invoke("Say something.")
    assert msg.usage_metadata["output_tokens"] <= 2
    assert chat.invoke("Say something.", max_tokens=1).usage_metadata["output_tokens"] == 1
    llm = RagKVLLM(rag, max_tokens=1)
    result = llm.generate(["Say something."])
    assert result.generations[0][0].generation_info[_bridge.STATS_KEY]["generated_tokens"] == 1
    assert RagKVRetriever(rag).engine is rag


def test_metadata_names_the_real_model(rag):
    msg = ChatRagKV(rag, max_tokens=1).invoke("Hi")
    assert msg.response_metadata["model_name"] == rag.adapter.name
    with pytest.raises(ValueError, match="not the model this engine runs"):
        ChatRagKV(rag, model="gpt-4o")
    assert ChatRagKV(rag, model=rag.adapter.name)._name() == rag.adapter.name


def test_unsupported_settings_are_refused_or_warned(rag, caplog):
    with pytest.raises(TypeError, match="model_kwargs"):
        ChatRagKV(rag, model_kwargs={"top_k": 3})
    with pytest.raises(TypeError, match="unsupported settings \\['base_url'\\]"):
        RagKVLLM(rag, base_url="http://x")
    with caplog.at_level(logging.WARNING, logger="ragkv.integrations.langchain"):
        ChatRagKV(rag, timeout=30, max_retries=2)
    assert "timeout" in caplog.text and "max_retries" in caplog.text


def test_bind_tools_says_why(rag):
    with pytest.raises(NotImplementedError, match="tool calling"):
        ChatRagKV(rag).bind_tools([])
