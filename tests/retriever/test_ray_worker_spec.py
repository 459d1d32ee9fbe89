"""A Ray worker loads the model in the driver's resolved dtype (no Ray needed: the actor body is a class).

The bug: the spec carried only the model's name, so a worker loaded a saved fp32 folder in fp32 while
the driver's ``dtype="auto"`` ran it in bf16 on a CPU with native bf16; every actor then died with
"the model ... differs from the driver's (fingerprints ...)".
"""

from __future__ import annotations

import pytest

from ragkv.model import load_model
from ragkv.retriever.ray_index import ChunkWorker, WorkerSpec
from ragkv.types import CodecSpec
from tests.conftest import make_model, make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32-model")
    tok = make_tokenizer()
    make_model("qwen2", len(tok)).save_pretrained(path)  # saved in fp32
    tok.save_pretrained(path)
    return path


def _spec(model_dir, driver, dtype: str) -> WorkerSpec:
    return WorkerSpec(
        model=str(model_dir),
        store=("memory://",),
        tenant="default",
        store_secret=None,
        prefix_ids=(1, 2, 3),
        codecs=(CodecSpec("int8", 0),),
        model_fingerprint=driver.fingerprint,
        tokenizer_fingerprint=driver.tokenizer_fingerprint,
        dtype=dtype,
    )


def test_a_worker_loads_the_drivers_dtype_and_agrees_on_the_fingerprint(model_dir):
    driver = load_model(str(model_dir), dtype="bfloat16")  # what dtype="auto" gives on an avx512_bf16 CPU
    worker = ChunkWorker(_spec(model_dir, driver, "bfloat16"))
    assert worker.computer.adapter.fingerprint == driver.fingerprint
    with pytest.raises(ValueError, match="differs from the driver's"):  # the old behaviour: the folder's fp32
        ChunkWorker(_spec(model_dir, driver, "float32"))


def test_a_worker_codes_chunks_in_the_transform_the_driver_stored(model_dir, tmp_path):
    """The spec carries the transform setting; the worker reads the driver's transform from the shared store."""
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.retriever.documents import Document
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig

    driver = load_model(str(model_dir), dtype="float32")
    level1 = CodecSpec("cachegen", 1)
    config = EngineConfig(data_dir=tmp_path, retriever=RetrieverConfig(codec=level1), store=(str(tmp_path / "kv"),))
    with RagKV(config, adapter=driver, embedder=HashingEmbedder(dim=32)) as rag:
        rag.index([Document("mem:a", "Apples grow on trees in orchards. " * 8, "a")], progress=False)
        spec = WorkerSpec.for_retriever(rag.retriever, str(model_dir), [str(tmp_path / "kv")])
        assert spec.transform == rag.retriever.config.transform
        worker = ChunkWorker(spec)
        ids = (5, 6, 7, 8, 9, 10)
        assert worker.computer.chunk_key(ids, level1) == rag.retriever.computer.chunk_key(ids, level1)
        mine = worker.computer.transforms.current()
        assert mine is not None and mine.digest == rag.retriever.computer.transforms.current().digest
