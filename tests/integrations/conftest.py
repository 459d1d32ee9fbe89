"""Engines on the tiny random model for the framework integration tests (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 12 + "\n\nThey are red or green. " * 8, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 10 + "\n\nSails catch the wind. " * 9, "boats"),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 11, "clocks"),
]
GEN = GenerationConfig(max_new_tokens=6)


def make_engine(data_dir: Path, adapter, **kw) -> RagKV:
    cfg = EngineConfig(
        data_dir=data_dir,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        store=("memory://", str(data_dir / "kv")),
        **kw,
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def plain_text(rag: RagKV, prompt: str, max_new_tokens: int) -> str:
    """What the engine generates from ``prompt`` as one plain segment (the model alone)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    return "".join(delta for delta, _ in rag.generate_segments([prompt], generation=gen))


@pytest.fixture
def rag(tmp_path, llama_adapter):
    """A fresh engine with nothing indexed."""
    with make_engine(tmp_path, llama_adapter) as engine:
        yield engine


@pytest.fixture(scope="module")
def indexed_rag(tmp_path_factory, llama_adapter):
    """One engine with DOCS indexed, shared by a module's tests (indexing is the slow part).

    Tests on it may register texts but must not rely on an empty registry: use ``rag`` for that.
    """
    with make_engine(tmp_path_factory.mktemp("ragkv"), llama_adapter) as engine:
        engine.index(DOCS, progress=False)
        yield engine
