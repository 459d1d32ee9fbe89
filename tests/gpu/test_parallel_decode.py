"""On a GPU, chunks decoded side by side on the decode threads equal those decoded one by one, and
answer alike (raw stays on the host as fp16 views; cachegen decodes onto the device from a thread)."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.gpu.host_tier import HostTierConfig
from ragkv.gpu.tier import DeviceTierConfig
from tests.core.test_engine import DOCS, GEN


def _rag(data_dir, a, level: str, workers: int) -> RagKV:
    """An engine on ``a`` that decodes every chunk from the store (no tiers) on ``workers`` threads."""
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec

    retr = RetrieverConfig(
        top_k=3,
        chunker=ChunkerConfig(min_tokens=40, max_tokens=120),
        codec=CodecSpec(level, 0),
        decode_workers=workers,
    )
    cfg = EngineConfig(
        data_dir=data_dir,
        retriever=retr,
        store=("memory://",),
        device_tier=DeviceTierConfig(budget_bytes=0),
        host_tier=HostTierConfig(budget_bytes=0),
    )
    return RagKV(cfg, adapter=a, embedder=HashingEmbedder(dim=64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", ["raw", "cachegen"])
def test_on_cuda_decode_threads_equal_one_thread(tmp_path, tiny_tokenizer, level):
    from ragkv.model import load_model
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    question = "Where do apples grow?"
    texts = []
    loads = []
    for workers in (1, 4):
        with _rag(tmp_path / str(workers), a, level, workers) as rag:
            rag.index(DOCS, progress=False)
            assert rag.retriever.loader.decode_workers == workers
            chunks = [list(c.token_ids) for c in rag.retrieve(question, k=3)]
            loads.append(rag.retriever.loader.load_many(chunks))
            texts.append(rag.answer(question, generation=GEN).text)
    assert texts[0] == texts[1]
    for one, many in zip(*loads, strict=True):
        assert one.hit and many.hit
        assert many.kv.keys.device == one.kv.keys.device  # raw: the host; cachegen: the GPU
        assert torch.equal(one.kv.keys, many.kv.keys) and torch.equal(one.kv.values, many.kv.values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_decode_threads_upload_on_the_request_stream(tmp_path, tiny_tokenizer, monkeypatch):
    # A request running on a stream of its own (a caller's `with torch.cuda.stream(s)`) reads what
    # the decode threads uploaded: they must upload on that stream, not on their thread's default
    # one. Here the default stream is kept busy, so uploads queued there would land after the
    # request has read them.
    import ragkv.retriever.loader as loader_mod
    from ragkv.model import load_model
    from ragkv.retriever.decoding import OrderedDecodes
    from ragkv.retriever.documents import Document
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    # documents of its own: blocks the test before it freed hold its decodes, which a racy read
    # landing there would find right by chance
    docs = [Document(d.source, d.text.replace(" ", "  "), d.title) for d in DOCS]
    with _rag(tmp_path, a, "cachegen", 4) as rag:
        rag.index(docs, progress=False)
        chunks = [list(c.token_ids) for c in rag.retrieve("Where do apples grow?", k=3)]
        # kept alive: a later decode that reused these blocks would find the right values there
        first = rag.retriever.loader.load_many(chunks)
        want = [(x.kv.keys.clone(), x.kv.values.clone()) for x in first]
        torch.cuda.synchronize()

        def read_on_own_stream() -> bool:
            side = torch.cuda.Stream()
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(200_000_000)  # the default stream busy for about 0.1 s
            with torch.cuda.stream(side):
                loads = rag.retriever.loader.load_many(chunks)
                got = [(x.kv.keys.clone(), x.kv.values.clone()) for x in loads]
            torch.cuda.synchronize()
            del loads
            return all(
                torch.equal(gk, wk) and torch.equal(gv, wv) for (gk, gv), (wk, wv) in zip(got, want, strict=True)
            )

        with monkeypatch.context() as m:  # the control: decodes on their threads' default stream
            m.setattr(loader_mod, "OrderedDecodes", lambda workers, around=None: OrderedDecodes(workers))
            reproduced = not read_on_own_stream()
        assert read_on_own_stream()
        del first
        if not reproduced:
            pytest.skip(
                "the request's stream read right, but without it did too on this device: the test proved nothing"
            )
