"""On a GPU, chunks decoded side by side on the decode threads equal those decoded one by one, and
answer alike (raw stays on the host as fp16 views; cachegen decodes onto the device from a thread)."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.gpu.host_tier import HostTierConfig
from ragkv.gpu.tier import DeviceTierConfig
from tests.core.test_engine import DOCS, GEN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", ["raw", "cachegen"])
def test_on_cuda_decode_threads_equal_one_thread(tmp_path, tiny_tokenizer, level):
    from ragkv.model import load_model
    from ragkv.retriever.chunker import ChunkerConfig
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig
    from ragkv.types import CodecSpec
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    question = "Where do apples grow?"
    texts = []
    loads = []
    for workers in (1, 4):
        retr = RetrieverConfig(
            top_k=3,
            chunker=ChunkerConfig(min_tokens=40, max_tokens=120),
            codec=CodecSpec(level, 0),
            decode_workers=workers,
        )
        cfg = EngineConfig(
            data_dir=tmp_path / str(workers),
            retriever=retr,
            store=("memory://",),
            device_tier=DeviceTierConfig(budget_bytes=0),
            host_tier=HostTierConfig(budget_bytes=0),
        )
        with RagKV(cfg, adapter=a, embedder=HashingEmbedder(dim=64)) as rag:
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
