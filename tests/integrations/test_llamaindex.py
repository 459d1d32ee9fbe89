"""LlamaIndex: query engines (compact, tree_summarize, refine), chat engines, sync and async, on the tiny model."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import MetadataMode  # noqa: E402

from ragkv.integrations import _bridge  # noqa: E402
from ragkv.integrations.llamaindex import (  # noqa: E402
    RagKVEmbedding,
    RagKVLLM,
    RagKVNodePostprocessor,
    RagKVRetriever,
)
from tests.integrations.conftest import DOCS, plain_text  # noqa: E402

QUESTION = "Where do apples grow?"
MAX_NEW = 4
# short texts keep the prompts (byte-level tokens) small
TEXTS = {
    "mem:apples": "Apples grow on trees in orchards. They are red or green and taste sweet.",
    "mem:boats": "Boats float on water and carry people. Sails catch the wind on the lake.",
    "mem:clocks": "Clocks measure time with gears and springs, and chime every hour.",
}


@pytest.fixture
def llm(rag):
    return RagKVLLM(rag, max_new_tokens=MAX_NEW)


@pytest.fixture
def index(rag):
    docs = [Document(text=text, metadata={"source": source}) for source, text in TEXTS.items()]
    return VectorStoreIndex.from_documents(
        docs, embed_model=RagKVEmbedding(rag), transformations=[SentenceSplitter(chunk_size=1024)]
    )


def stats_of(response) -> dict:
    return response.metadata[_bridge.STATS_KEY]


def engine_for(index, llm, rag, **kw):
    return index.as_query_engine(llm=llm, node_postprocessors=[RagKVNodePostprocessor(rag)], similarity_top_k=2, **kw)


@pytest.mark.parametrize("mode, calls", [("compact", 1), ("tree_summarize", 1), ("refine", 2)])
def test_query_engine_reuses_every_chunk_on_the_second_query(index, llm, rag, mode, calls):
    qe = engine_for(index, llm, rag, response_mode=mode)
    first = stats_of(qe.query(QUESTION))
    second = qe.query(QUESTION)
    s = stats_of(second)
    assert first["chunks_in_prompt"] == s["chunks_in_prompt"] == 2
    assert s["llm_calls"] == calls and len(s["calls"]) == calls
    assert s["cache_hits"] == 2 and s["cache_misses"] == 0 and s["prefilled_chunk_tokens"] == 0
    assert s["reused_tokens"] + s["recomputed_tokens"] > 0 and s["ttft_ms"] > 0
    assert second.source_nodes and str(second)


@pytest.mark.parametrize("mode, calls", [("simple_summarize", 1), ("accumulate", 2)])
def test_other_response_modes_find_the_chunks(index, llm, rag, mode, calls):
    s = stats_of(engine_for(index, llm, rag, response_mode=mode).query(QUESTION))
    assert s["llm_calls"] == calls and s["chunks_in_prompt"] == 2


def test_condense_question_and_simple_chat_engines(index, llm, rag):
    condense = index.as_chat_engine(
        chat_mode="condense_question", llm=llm, similarity_top_k=2, node_postprocessors=[RagKVNodePostprocessor(rag)]
    )
    s = condense.chat(QUESTION).metadata[_bridge.STATS_KEY]  # no history yet: nothing to condense
    assert s["llm_calls"] == 1 and s["chunks_in_prompt"] == 2
    simple = index.as_chat_engine(chat_mode="simple", llm=llm)
    assert simple.chat("Hello").metadata[_bridge.STATS_KEY]["chunks_in_prompt"] == 0


def test_postprocessor_registers_the_llm_view_of_each_node_and_stores_its_cache(index, rag):
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    pp = RagKVNodePostprocessor(rag)
    assert pp.postprocess_nodes(nodes) == nodes
    registry = _bridge.registry(rag)
    for n in nodes:
        text = n.node.get_content(metadata_mode=MetadataMode.LLM)
        assert text in registry and text.startswith("source: mem:")
    assert _bridge.warm(rag, [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]) == 0


def test_streaming_query_fills_its_stats_once_consumed(index, llm, rag):
    qe = engine_for(index, llm, rag, streaming=True)
    qe.query(QUESTION).get_response()
    response = qe.query(QUESTION)
    text = "".join(response.response_gen)
    s = stats_of(response)
    assert text and s["llm_calls"] == 1 and s["cache_hits"] == 2 and s["prefilled_chunk_tokens"] == 0


def test_async_query_and_async_streaming(index, llm, rag):
    async def main():
        qe = engine_for(index, llm, rag)
        await qe.aquery(QUESTION)
        plain = await qe.aquery(QUESTION)
        streaming = await engine_for(index, llm, rag, streaming=True).aquery(QUESTION)
        text = "".join([t async for t in streaming.async_response_gen()])
        return plain, streaming, text

    plain, streaming, text = asyncio.run(main())
    assert stats_of(plain)["cache_hits"] == 2 and stats_of(plain)["prefilled_chunk_tokens"] == 0
    assert text == str(plain) and stats_of(streaming)["cache_hits"] == 2


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_chat_engines_sync_streaming_and_async(index, llm, rag, chat_mode):
    chat = index.as_chat_engine(
        chat_mode=chat_mode, llm=llm, node_postprocessors=[RagKVNodePostprocessor(rag)], similarity_top_k=2
    )
    answer = chat.chat(QUESTION)
    assert answer.response and answer.metadata[_bridge.STATS_KEY]["chunks_in_prompt"] == 2
    streamed = chat.stream_chat(QUESTION)
    assert "".join(streamed.response_gen)
    assert streamed.metadata[_bridge.STATS_KEY]["cache_hits"] == 2

    async def main():
        return await chat.achat(QUESTION)

    assert asyncio.run(main()).metadata[_bridge.STATS_KEY]["prefilled_chunk_tokens"] == 0


def test_retriever_over_ragkv_index_needs_no_postprocessor(indexed_rag):
    llm = RagKVLLM(indexed_rag, max_new_tokens=MAX_NEW)
    qe = RetrieverQueryEngine.from_args(RagKVRetriever(indexed_rag, k=2), llm=llm)
    first = qe.query(QUESTION)
    assert [n.node.metadata["source"] for n in first.source_nodes][0] == "mem:apples"
    assert stats_of(first)["chunks_in_prompt"] == 2
    # LlamaIndex strips chunk texts, and ragkv's chunker keeps trailing whitespace, so the first
    # query computes the stripped forms (see docs/integrations-llamaindex.md); then all are hits
    second = stats_of(qe.query(QUESTION))
    assert second["cache_hits"] == 2 and second["prefilled_chunk_tokens"] == 0


def test_retriever_rejects_bad_k(rag):
    with pytest.raises(ValueError, match="k must be"):
        RagKVRetriever(rag, k=0)


def test_llm_calls_agree_and_carry_stats(rag, llm):
    msgs = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content=QUESTION),
    ]
    chat = llm.chat(msgs)
    streamed = list(llm.stream_chat(msgs))
    assert streamed[-1].message.content == chat.message.content
    assert streamed[-1].additional_kwargs[_bridge.STATS_KEY]["generated_tokens"] > 0
    assert all(_bridge.STATS_KEY not in r.additional_kwargs for r in streamed[:-1])
    done = llm.complete(QUESTION)
    assert "".join(r.delta for r in llm.stream_complete(QUESTION)) == done.text
    assert done.additional_kwargs[_bridge.STATS_KEY]["prompt_tokens"] > 0

    async def main():
        a = await llm.acomplete(QUESTION)
        b = "".join([r.delta async for r in await llm.astream_complete(QUESTION)])
        c = await llm.achat(msgs)
        d = [r async for r in await llm.astream_chat(msgs)]
        return a, b, c, d

    a, b, c, d = asyncio.run(main())
    assert a.text == b == done.text and c.message.content == d[-1].message.content == chat.message.content


def test_prompt_without_known_chunks_is_the_plain_model(rag, llm):
    _bridge.registry(rag).add([*TEXTS.values(), *(d.text for d in DOCS)])
    prompt = "Tell me about rivers and mountains."
    got = llm.complete(prompt)
    assert got.additional_kwargs[_bridge.STATS_KEY]["chunks_in_prompt"] == 0
    rendered = rag.render_completion(prompt, chat_template=True)
    assert got.text == plain_text(rag, rendered, MAX_NEW)
    raw = llm.complete(prompt, formatted=True)  # formatted: the prompt is used as is
    assert raw.text == plain_text(rag, prompt, MAX_NEW)


def test_metadata_is_the_models(rag, llm):
    meta = llm.metadata
    assert meta.context_window == rag.adapter.spec.max_context
    assert meta.num_output == MAX_NEW and meta.is_chat_model and meta.model_name == rag.adapter.name


def test_generation_settings_can_be_overridden_per_call(llm):
    assert llm.complete(QUESTION, max_new_tokens=2).additional_kwargs[_bridge.STATS_KEY]["generated_tokens"] <= 2


def test_embedding_is_the_engines_embedder(rag):
    emb = RagKVEmbedding(rag)
    vec = emb.get_text_embedding("apples")
    assert vec == pytest.approx(rag.embedder.embed(["apples"])[0].tolist())
    assert emb.get_query_embedding("apples") == vec
