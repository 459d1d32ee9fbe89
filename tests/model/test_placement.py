"""dtype and device as settings: names, the auto rules, and a model placed by load_model."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import EngineConfig
from ragkv.model import load_model, placement
from tests.conftest import make_model


def test_names_resolve_and_unknown_ones_say_what_to_use():
    cpu = torch.device("cpu")
    assert placement.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert placement.resolve_dtype("float16", cpu) == torch.float16
    assert placement.resolve_dtype(None, cpu) is None
    with pytest.raises(ValueError, match="auto, float32, bfloat16 or float16"):
        placement.resolve_dtype("int3", cpu)
    assert placement.resolve_device("cpu") == cpu
    with pytest.raises(ValueError, match="cuda"):
        placement.resolve_device("tpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native):
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    assert placement.resolve_dtype("auto", torch.device("cpu")) == want


def test_auto_device_is_cuda_when_there_is_one():
    if torch.cuda.is_available():
        assert placement.resolve_device("auto").type == "cuda"
        return
    assert placement.resolve_device("auto").type in ("cpu", "mps")
    with pytest.raises(ValueError, match="no CUDA"):
        placement.resolve_device("cuda:0")


def test_engine_config_validates_and_reads_the_environment(monkeypatch):
    assert (EngineConfig().dtype, EngineConfig().device) == ("auto", "auto")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="cuda:x")
    monkeypatch.setenv("RAGKV_DTYPE", "bfloat16")
    monkeypatch.setenv("RAGKV_DEVICE", "cpu")
    cfg = EngineConfig.from_env()
    assert (cfg.dtype, cfg.device) == ("bfloat16", "cpu")


def test_load_model_places_a_model_in_the_dtype_asked(tiny_tokenizer):
    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cpu", dtype="bfloat16")
    assert a.dtype == torch.bfloat16 and a.device.type == "cpu"
    assert a.rotated_layers.all()  # the load-time probe passes in bf16 too


def test_auto_decode_weights_follow_the_device_and_the_files_bits():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert placement.resolve_decode_weights("auto", cpu, 4)[0] == "int8"
    assert placement.resolve_decode_weights("auto", cpu, 8)[0] == "int8"
    assert placement.resolve_decode_weights("auto", cpu, 16) == ("model", "auto: the file stores 16-bit weights")
    assert placement.resolve_decode_weights("auto", cpu, None)[0] == "model"
    assert placement.resolve_decode_weights("auto", cuda, 4)[0] == "model"  # the int8 kernels are the CPU's
    assert placement.resolve_decode_weights("int4", cuda, None) == ("int4", "asked for")


@pytest.mark.slow
def test_the_default_models_file_is_4_bit_and_its_adapter_says_so(real_adapter):
    from ragkv.bench.peer import gguf_path
    from ragkv.model.gguf_header import read_tensor_types, weight_bits

    types = read_tensor_types(gguf_path("smollm2-135m"))
    assert {kind for name, (kind, dims) in types.items() if name.startswith("blk.") and len(dims) == 2} == {"Q4_1"}
    assert types["token_embd.weight"] == ("Q8_0", (576, 49152))
    assert weight_bits(gguf_path("smollm2-135m")) == 4 and real_adapter.weight_bits == 4
