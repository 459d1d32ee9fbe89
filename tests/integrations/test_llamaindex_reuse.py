"""LlamaIndex: reuse in every response mode, without the postprocessor, standard settings, first-query cost."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from ragkv.fusion import FusionConfig  # noqa: E402
from ragkv.integrations import _bridge  # noqa: E402
from ragkv.integrations.llamaindex import RagKVEmbedding, RagKVLLM, RagKVNodePostprocessor  # noqa: E402
from ragkv.planner.config import LoadConfig  # noqa: E402
from ragkv.retriever.documents import Document as RagDocument  # noqa: E402
from ragkv.types import DEFAULT_CODEC  # noqa: E402
from tests.integrations.conftest import make_engine  # noqa: E402

QUESTION = "Where do apples grow?"
# newlines and quotes: simple_summarize prints the chunk list, escaping both
TEXTS = {
    "mem:apples": "Apples grow on trees in orchards.\nThey're red or green and taste sweet.",
    "mem:boats": "Boats float on water and carry people.\nSails catch the wind on the lake.",
    "mem:clocks": "Clocks measure time with gears and springs, and chime every hour.",
}
MODES = ["compact", "refine", "tree_summarize", "simple_summarize", "accumulate", "compact_accumulate"]


@pytest.fixture
def index(rag):
    docs = [Document(text=text, metadata={"source": source}) for source, text in TEXTS.items()]
    return VectorStoreIndex.from_documents(
        docs, embed_model=RagKVEmbedding(rag), transformations=[SentenceSplitter(chunk_size=1024)]
    )


def query_engine(index, rag, *, postprocessor: bool = True, max_tokens: int = 3, **kw):
    pp = [RagKVNodePostprocessor(rag, progress=False)] if postprocessor else []
    llm = RagKVLLM(rag, max_tokens=max_tokens)
    return index.as_query_engine(llm=llm, node_postprocessors=pp, similarity_top_k=2, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_every_response_mode_reuses_on_the_second_identical_query(index, rag, mode):
    qe = query_engine(index, rag, response_mode=mode)
    qe.query(QUESTION)
    s = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
    assert s["reused_tokens"] > 0 and s["cache_hits"] >= 2 and s["cache_misses"] == 0
    assert "reuse_warning" not in s


@pytest.mark.parametrize("mode", MODES)
def test_full_recomputation_answers_exactly_like_the_plain_model(tmp_path, llama_adapter, mode):
    # Issue 13 point 4 (tree_summarize answered another question with reuse) was fusion at the
    # default ratio, not the prompt layout or chunk boundaries: with every chunk token recomputed
    # the reused path must give the plain model's answer, in every mode, from loaded caches.
    # (The byte-level test tokenizer cuts segments exactly as it cuts the whole prompt.) The load
    # is fixed: at ratio 1.0 the planner rightly recomputes from text rather than load caches.
    load = LoadConfig(fixed=DEFAULT_CODEC)
    with make_engine(tmp_path, llama_adapter, fusion=FusionConfig(ratio=1.0), load=load) as rag:
        docs = [Document(text=text, metadata={"source": source}) for source, text in TEXTS.items()]
        index = VectorStoreIndex.from_documents(
            docs, embed_model=RagKVEmbedding(rag), transformations=[SentenceSplitter(chunk_size=1024)]
        )
        plain = index.as_query_engine(
            llm=RagKVLLM(rag, max_tokens=8, reuse_chunks=False), similarity_top_k=2, response_mode=mode
        )
        reuse = query_engine(index, rag, max_tokens=8, response_mode=mode)
        reuse.query(QUESTION)  # builds the caches
        response = reuse.query(QUESTION)
        s = response.metadata[_bridge.STATS_KEY]
        assert s["cache_hits"] >= 2 and s["cache_misses"] == 0 and s["reused_tokens"] == 0
        assert str(response) == str(plain.query(QUESTION))


def test_first_query_reports_cache_building_and_the_users_ttft(index, rag):
    qe = query_engine(index, rag, response_mode="refine")
    first = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
    assert first["caches_built"] == 2 and first["cache_build_ms"] > 0
    # the user waits for retrieval, cache building and refine's first call before the answer starts
    assert first["ttft_ms"] >= first["cache_build_ms"] + first["calls"][0]["total_ms"]
    assert first["llm_ttft_ms"] == first["calls"][-1]["ttft_ms"]
    second = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
    assert second["caches_built"] == 0 and second["llm_calls"] == 2


def test_llm_without_postprocessor_finds_the_engines_indexed_chunks(rag):
    rag.index([RagDocument("mem:apples", TEXTS["mem:apples"] * 3, "apples")], progress=False)
    chunk = rag.retrieve(QUESTION, 1)[0]
    index = VectorStoreIndex([TextNode(text=chunk.text)], embed_model=RagKVEmbedding(rag))
    qe = query_engine(index, rag, postprocessor=False)
    first = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
    assert first["chunks_in_prompt"] == 1 and "reuse_warning" not in first
    # LlamaIndex strips the text; that form's cache is computed by the first query
    s = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
    assert s["cache_hits"] == 1 and s["prefilled_chunk_tokens"] == 0 and s["reused_tokens"] > 0


def test_llm_without_any_known_chunk_warns_once_and_says_so_in_the_stats(index, rag, caplog):
    qe = query_engine(index, rag, postprocessor=False)
    with caplog.at_level(logging.WARNING, logger="ragkv.integrations._bridge"):
        s = qe.query(QUESTION).metadata[_bridge.STATS_KEY]
        qe.query(QUESTION)
    assert s["chunks_in_prompt"] == 0 and "RagKVNodePostprocessor" in s["reuse_warning"]
    assert len([r for r in caplog.records if "reuses no chunk cache" in r.message]) == 1


def test_max_tokens_is_llamaindexs_name_for_the_answer_cap(rag):
    llm = RagKVLLM(rag, max_tokens=2)
    assert llm.max_new_tokens == 2 and llm.metadata.num_output == 2
    assert llm.complete(QUESTION).additional_kwargs[_bridge.STATS_KEY]["generated_tokens"] <= 2
    assert llm.complete(QUESTION, max_tokens=1).additional_kwargs[_bridge.STATS_KEY]["generated_tokens"] == 1


def test_context_window_and_unsupported_settings(rag):
    assert RagKVLLM(rag, context_window=64).metadata.context_window == 64
    with pytest.raises(ValueError, match="context length"):
        RagKVLLM(rag, context_window=rag.adapter.spec.max_context + 1)
    with pytest.raises(TypeError, match="unsupported settings \\['api_key'\\]"):
        RagKVLLM(rag, api_key="x")
    with pytest.raises(ValueError, match="disagree"):
        RagKVLLM(rag, max_tokens=2, max_new_tokens=3)
