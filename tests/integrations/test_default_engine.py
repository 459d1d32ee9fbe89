"""The integrations' default engine (no ``engine=`` given) takes the model's dtype and device from the environment.

Both frameworks build it through ``_bridge.default_engine()``, i.e. ``EngineConfig.from_env()``;
it cannot be pointed at the tiny test model, so the dtype test loads the real default model
(``slow``). The device test needs no model: asking for CUDA where torch sees none fails before
anything loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ragkv.integrations import _bridge


@pytest.fixture
def env(tmp_path, monkeypatch) -> Iterator[pytest.MonkeyPatch]:
    """A fresh process-wide default engine slot, data under ``tmp_path``, no downloads."""
    monkeypatch.setenv("RAGKV_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(_bridge, "_DEFAULT", [])
    yield monkeypatch
    for engine in _bridge._DEFAULT:
        engine.close()


@pytest.mark.slow
def test_both_frameworks_default_engine_runs_in_ragkv_dtype_on_ragkv_device(env) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from ragkv.integrations.langchain import ChatRagKV
    from ragkv.integrations.llamaindex import RagKVLLM

    env.setenv("RAGKV_DTYPE", "float16")  # neither of auto's choices (fp32, bf16): only the variable picks it
    env.setenv("RAGKV_DEVICE", "cpu")
    engine = ChatRagKV()._engine()
    assert engine.config.dtype == "float16" and engine.config.device == "cpu"
    assert engine.adapter.dtype == torch.float16 and engine.adapter.device.type == "cpu"
    assert RagKVLLM().engine is engine  # one default engine per process, LlamaIndex's too


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
def test_ragkv_device_reaches_the_model_loader(env, framework: str) -> None:
    env.setenv("RAGKV_DEVICE", "cuda")
    if framework == "langchain":
        pytest.importorskip("langchain_core")
        from ragkv.integrations.langchain import ChatRagKV

        with pytest.raises(ValueError, match="device 'cuda' asked for but torch sees no CUDA device"):
            ChatRagKV()._engine()
    else:
        pytest.importorskip("llama_index.core")
        from ragkv.integrations.llamaindex import RagKVLLM

        with pytest.raises(ValueError, match="device 'cuda' asked for but torch sees no CUDA device"):
            RagKVLLM()
    assert _bridge._DEFAULT == []


def test_a_bad_ragkv_dtype_is_refused_with_the_choices(env) -> None:
    pytest.importorskip("langchain_core")
    from ragkv.integrations.langchain import ChatRagKV

    env.setenv("RAGKV_DTYPE", "int8")
    with pytest.raises(ValueError, match="unknown dtype 'int8'; use auto, float32, bfloat16 or float16"):
        ChatRagKV()._engine()
