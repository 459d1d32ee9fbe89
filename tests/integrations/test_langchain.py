"""LangChain: LCEL RAG chains, a stuff-documents chain, streaming, async, the LLM and the retriever."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from ragkv.integrations import _bridge  # noqa: E402
from ragkv.integrations.langchain import ChatRagKV, RagKVLLM, RagKVRetriever, register_texts  # noqa: E402
from tests.integrations.conftest import plain_text  # noqa: E402

QUESTION = "Where do apples grow?"
MAX_NEW = 4
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer from the context."),
        ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
    ]
)


def join_docs(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


def rag_chain(rag, k: int = 2):
    retriever = RagKVRetriever(engine=rag, k=k)
    return (
        {"context": retriever | join_docs, "question": RunnablePassthrough()}
        | PROMPT
        | ChatRagKV(engine=rag, max_tokens=MAX_NEW)
    )


def test_lcel_chain_loads_index_time_caches_on_the_first_query(indexed_rag):
    msg = rag_chain(indexed_rag).invoke(QUESTION)
    s = msg.response_metadata[_bridge.STATS_KEY]
    assert s["chunks_in_prompt"] == 2 and s["cache_hits"] == 2 and s["prefilled_chunk_tokens"] == 0
    usage = msg.usage_metadata
    assert usage["input_tokens"] == s["prompt_tokens"] and usage["output_tokens"] == s["generated_tokens"]
    assert usage["input_token_details"]["cache_read"] == s["reused_tokens"] + s["recomputed_tokens"] > 0
    assert msg.response_metadata["model_name"] == indexed_rag.adapter.name


def test_stuff_documents_chain_with_a_document_prompt_and_the_text_llm(indexed_rag):
    # what langchain's create_stuff_documents_chain does: format each document, join, fill the prompt
    doc_prompt = PromptTemplate.from_template("Source: {source}\n{page_content}")

    def stuff(docs) -> str:
        return "\n\n".join(format_document(d, doc_prompt) for d in docs)

    prompt = PromptTemplate.from_template("Use the documents.\n\n{context}\n\nQuestion: {question}\nAnswer:")
    llm = RagKVLLM(engine=indexed_rag, max_tokens=MAX_NEW)
    chain = (
        {"context": RagKVRetriever(engine=indexed_rag, k=2) | stuff, "question": RunnablePassthrough()} | prompt | llm
    )
    result = chain.invoke(QUESTION)
    assert isinstance(result, str)
    gen = llm.generate(
        [prompt.format(context=stuff(RagKVRetriever(engine=indexed_rag, k=2).invoke(QUESTION)), question=QUESTION)]
    ).generations[0][0]
    s = gen.generation_info[_bridge.STATS_KEY]
    assert gen.text == result and s["chunks_in_prompt"] == 2 and s["prefilled_chunk_tokens"] == 0


def test_documents_from_elsewhere_are_plain_until_registered(rag):
    texts = [
        "Pears ripen in autumn on old trees by the river bank.",
        "Plums are dried into prunes in the sunny southern valleys.",
    ]
    msgs = [HumanMessage("Context:\n" + "\n\n".join(texts) + "\n\nQuestion: when do pears ripen?")]
    model = ChatRagKV(engine=rag, max_tokens=MAX_NEW)
    before = model.invoke(msgs)
    assert before.response_metadata[_bridge.STATS_KEY]["chunks_in_prompt"] == 0
    prompt = rag.render_chat([{"role": "user", "content": msgs[0].content}])
    assert before.content == plain_text(rag, prompt, MAX_NEW)
    register_texts(rag, texts)
    first = model.invoke(msgs).response_metadata[_bridge.STATS_KEY]
    second = model.invoke(msgs).response_metadata[_bridge.STATS_KEY]
    assert first["chunks_in_prompt"] == 2 and first["cache_misses"] == 2
    assert second["cache_hits"] == 2 and second["prefilled_chunk_tokens"] == 0
    baseline = ChatRagKV(engine=rag, max_tokens=MAX_NEW, reuse_chunks=False).invoke(msgs)
    assert baseline.response_metadata[_bridge.STATS_KEY]["chunks_in_prompt"] == 0
    assert baseline.content == before.content


class _Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_streaming_goes_through_callbacks_and_ends_with_usage(indexed_rag):
    chain = rag_chain(indexed_rag)
    done = chain.invoke(QUESTION)
    handler = _Tokens()
    chunks = list(chain.stream(QUESTION, config={"callbacks": [handler]}))
    assert "".join(c.content for c in chunks) == done.content == "".join(handler.tokens)
    last = chunks[-1]
    assert last.chunk_position == "last" and last.usage_metadata["output_tokens"] > 0
    assert all(c.usage_metadata is None for c in chunks[:-1])
    assert last.response_metadata[_bridge.STATS_KEY]["cache_hits"] == 2


def test_async_invoke_and_stream_match_sync(indexed_rag):
    chain = rag_chain(indexed_rag)
    done = chain.invoke(QUESTION)

    async def main():
        a = await chain.ainvoke(QUESTION)
        b = [c.content async for c in chain.astream(QUESTION)]
        return a, "".join(b)

    a, b = asyncio.run(main())
    assert a.content == b == done.content
    assert a.response_metadata[_bridge.STATS_KEY]["prefilled_chunk_tokens"] == 0


def test_batch_runs_concurrent_calls_one_at_a_time(indexed_rag):
    model = ChatRagKV(engine=indexed_rag, max_tokens=MAX_NEW)
    prompts = ["Hello", "Tell me about boats"]
    assert [m.content for m in model.batch(prompts)] == [model.invoke(p).content for p in prompts]


def test_messages_render_with_the_chat_template(rag):
    model = ChatRagKV(engine=rag, max_tokens=MAX_NEW)
    msgs = [SystemMessage("Be brief."), HumanMessage("Hi", name="someone")]
    got = model.invoke(msgs)
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert got.content == plain_text(rag, prompt, MAX_NEW)
    assert got.response_metadata[_bridge.STATS_KEY]["prompt_tokens"] == len(rag.adapter.encode(prompt))


def test_stop_strings_and_per_call_settings(rag):
    model = ChatRagKV(engine=rag, max_tokens=8)
    full = model.invoke("Hello").content
    stop = next(ch for ch in full[1:] if ch != "\ufffd")  # random weights: stop at a whole character
    assert model.invoke("Hello", stop=[stop]).content == full[: full.index(stop)]
    assert ChatRagKV(engine=rag, max_tokens=8, stop=[stop]).invoke("Hello").content == full[: full.index(stop)]
    assert model.invoke("Hello", max_tokens=1).usage_metadata["output_tokens"] <= 1
    with pytest.raises(ValueError, match="serves"):
        model.invoke("Hello", model="another-model")


def test_text_llm_raw_and_templated(rag):
    templated = RagKVLLM(engine=rag, max_tokens=MAX_NEW)
    raw = RagKVLLM(engine=rag, max_tokens=MAX_NEW, chat_template=False)
    prompt = "Tell me about rivers."
    assert raw.invoke(prompt) == plain_text(rag, prompt, MAX_NEW)
    rendered = rag.render_completion(prompt, chat_template=True)
    assert templated.invoke(prompt) == plain_text(rag, rendered, MAX_NEW)
    assert "".join(templated.stream(prompt)) == templated.invoke(prompt)

    async def main():
        return await templated.ainvoke(prompt), "".join([t async for t in templated.astream(prompt)])

    assert asyncio.run(main()) == (templated.invoke(prompt),) * 2


def test_retriever_honours_k_and_returns_chunk_metadata(indexed_rag):
    retriever = RagKVRetriever(engine=indexed_rag, k=3)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 3 and len(retriever.invoke(QUESTION, k=1)) == 1
    assert docs[0].metadata["source"] == "mem:apples" and docs[0].id == docs[0].metadata["chunk_id"]
    assert all(d.page_content in _bridge.registry(indexed_rag) for d in docs)
    assert len(RagKVRetriever(engine=indexed_rag).invoke(QUESTION)) == indexed_rag.config.retriever.top_k


def test_chain_output_parser_gives_text(indexed_rag):
    text = (rag_chain(indexed_rag) | StrOutputParser()).invoke(QUESTION)
    assert isinstance(text, str) and text
