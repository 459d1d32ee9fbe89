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
