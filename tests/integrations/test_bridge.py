"""What both adapters share: per-engine registry, warm, generation, the async bridge, rendering, stats."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from ragkv.generation import GenerationConfig
from ragkv.integrations import _bridge
from ragkv.prompt import render_chat, render_completion
from tests.integrations.conftest import DOCS, GEN, make_engine

QUESTION = [{"role": "user", "content": "Where do apples grow?"}]


def hf_greedy(adapter, prompt: str, max_new_tokens: int) -> str:
    """The slow, obvious path: transformers' own generate on the whole prompt."""
    ids = torch.tensor([adapter.encode(prompt)])
    out = adapter.model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(adapter.eos_token_ids), pad_token_id=0
    )
    return adapter.decode(out[0, ids.shape[1] :].tolist())


def test_prompt_without_known_chunks_generates_like_the_plain_model(indexed_rag):
    tok = indexed_rag.adapter.tokenizer
    _bridge.registry(indexed_rag).add([c.text for c in indexed_rag.retrieve("apples", 3)])
    prompt = render_chat(tok, [{"role": "user", "content": "Tell me about rivers and mountains."}])
    out = list(_bridge.stream(indexed_rag, prompt, GenerationConfig(max_new_tokens=8)))
    stats = out[-1][1]
    assert stats.cache_hits == stats.cache_misses == stats.extra["chunks_in_prompt"] == 0
    assert "".join(d for d, _ in out) == hf_greedy(indexed_rag.adapter, prompt, 8)


def test_registered_chunks_are_loaded_from_the_index(indexed_rag):
    chunks = indexed_rag.retrieve("apples orchards", 2)
    _bridge.registry(indexed_rag).add([c.text for c in chunks])
    context = "\n\n".join(c.text for c in chunks)
    prompt = render_chat(
        indexed_rag.adapter.tokenizer, [{"role": "user", "content": f"Context:\n{context}\n\nQuestion: where?"}]
    )
    *_, (_, stats) = _bridge.stream(indexed_rag, prompt, GEN)
    assert stats.extra["chunks_in_prompt"] == 2
    assert stats.cache_hits == 2 and stats.cache_misses == 0 and stats.prefilled_chunk_tokens == 0


def test_warm_computes_missing_caches_once_and_registers(rag):
    texts = [DOCS[0].text[:200], DOCS[1].text[:200]]
    assert _bridge.warm(rag, texts) == 2
    assert _bridge.warm(rag, texts) == 0
    assert all(t in _bridge.registry(rag) for t in texts)
    prompt = rag.render_chat([{"role": "user", "content": "\n\n".join(texts) + "\n\nQ?"}])
    *_, (_, stats) = _bridge.stream(rag, prompt, GEN)
    assert stats.cache_hits == 2 and stats.prefilled_chunk_tokens == 0


def test_registries_are_per_engine(tmp_path, llama_adapter):
    with make_engine(tmp_path / "a", llama_adapter) as a, make_engine(tmp_path / "b", llama_adapter) as b:
        _bridge.registry(a).add([DOCS[0].text])
        assert DOCS[0].text in _bridge.registry(a)
        assert DOCS[0].text not in _bridge.registry(b)
        assert _bridge.engine_state(a) is _bridge.engine_state(a)


def test_empty_prompt_is_refused(rag):
    with pytest.raises(ValueError, match="empty"):
        list(_bridge.stream(rag, "", GEN))


def test_render_chat_uses_the_template_or_a_plain_transcript(tiny_tokenizer):
    rendered = render_chat(tiny_tokenizer, QUESTION)
    assert rendered == "<|im_start|>user\nWhere do apples grow?<|im_end|>\n<|im_start|>assistant\n"

    class NoTemplate:
        chat_template = None

    assert render_chat(NoTemplate(), QUESTION) == "user: Where do apples grow?\nassistant:"
    assert render_completion(tiny_tokenizer, "hi", chat_template=False) == "hi"
    with pytest.raises(ValueError, match="at least one"):
        render_chat(tiny_tokenizer, [])


def test_summarize_sums_counters_and_keeps_the_first_ttft():
    calls = [
        {"ttft_ms": 5.0, "cache_hits": 2, "prefilled_chunk_tokens": 0, "total_ms": 9.0},
        {"ttft_ms": 7.0, "cache_hits": 1, "prefilled_chunk_tokens": 4, "total_ms": 3.0},
    ]
    s = _bridge.summarize(calls)
    assert s["llm_calls"] == 2 and s["ttft_ms"] == 5.0 and s["cache_hits"] == 3
    assert s["prefilled_chunk_tokens"] == 4 and s["total_ms"] == 12.0 and len(s["calls"]) == 2
    assert _bridge.summarize([])["llm_calls"] == 0


def test_aiterate_runs_the_whole_stream_on_one_thread():
    threads: set[int] = set()

    def items():
        for i in range(5):
            threads.add(threading.get_ident())
            yield i

    async def main():
        return [i async for i in _bridge.aiterate(items)]

    assert asyncio.run(main()) == list(range(5))
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_aiterate_raises_the_producer_error_and_closes_on_early_stop():
    closed = threading.Event()

    def failing():
        yield 1
        raise RuntimeError("boom")

    def endless():
        try:
            while True:
                yield 0
        finally:
            closed.set()

    async def main():
        got = [i async for i in _bridge.aiterate(failing)]
        return got

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(main())

    async def stop_early():
        gen = _bridge.aiterate(endless)
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(stop_early())
    assert closed.wait(5)
