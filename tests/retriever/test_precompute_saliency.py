"""Indexing at a salient-token level measures each chunk's attention and keeps those tokens finer."""

from __future__ import annotations

import torch

from ragkv import codec
from ragkv.cache.store import open_store
from ragkv.codec.cachegen import LEVELS
from ragkv.codec.saliency import normalized_attention
from ragkv.model import AttentionProbe
from ragkv.retriever.precompute import ChunkComputer
from ragkv.types import CodecSpec

SALIENT = next(level for level, s in LEVELS.items() if s.salient_share > 0)


def test_a_salient_level_stores_the_tokens_the_chunk_attends_to_most(llama_adapter) -> None:
    store = open_store("memory://")
    spec = CodecSpec("cachegen", SALIENT)
    computer = ChunkComputer(llama_adapter, store, [1, 2, 3], [spec, CodecSpec("cachegen", 0)], tenant="t")
    chunk = tuple(range(5, 45))
    result = computer.ensure_stored(chunk)
    assert result.ok and len(result.entries) == 2
    key = computer.chunk_key(chunk, spec)
    header = codec.read_header(store.get(key.storage_key))
    # what the index path measured: the chunk's own normalized attention, from its prefill
    probe = AttentionProbe(None)
    kv = llama_adapter.prefill_kv(list(chunk), past=[computer.prefix_kv()], probe=probe)
    saliency = normalized_attention(probe.weights, kv.num_tokens)
    want = torch.topk(saliency[1:], len(header.params["salient"])).indices.sort().values.tolist()
    assert header.params["salient"] == want
    plain = codec.read_header(store.get(computer.chunk_key(chunk, CodecSpec("cachegen", 0)).storage_key))
    assert "salient" not in plain.params
