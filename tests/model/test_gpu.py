"""The CUDA path: exactness of re-rotation and fusion on the device, in fp32 and bf16 (skipped without CUDA).

Tolerances: fp32 as on the CPU; bf16 relative to the largest entry, since two bf16 runs of one
sequence at other positions already differ by bf16 rounding (about 2^-8 per op, compounded).
"""

from __future__ import annotations

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from tests.conftest import make_model
from tests.model.test_families import _ids, _shifted_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_REL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= _REL[dtype], f"relative error {float(err):.2e} > {_REL[dtype]:.0e} in {dtype}"


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_adapter(request, tiny_tokenizer) -> ModelAdapter:
    return load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=request.param)


def test_rerotation_on_the_device_equals_computing_at_the_target(cuda_adapter):
    a = cuda_adapter
    ids = _ids(40, 1)
    moved = a.rerotate(_shifted_kv(a, ids, 3), 700)
    assert moved.keys.is_cuda
    _close(moved.keys, _shifted_kv(a, ids, 700).keys, a.dtype)


def test_full_recomputation_on_the_device_equals_full_prefill(cuda_adapter):
    a = cuda_adapter
    prefix, chunk_ids, suffix = _ids(9, 2), [_ids(60, 3), _ids(80, 4), _ids(70, 5)], _ids(6, 6)
    pre = a.prefill_kv(prefix)
    inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in chunk_ids], chunk_ids, suffix)
    fused = fuse(a, inp, FusionConfig(method="full"))
    got = a.forward(suffix, fused.cache, fused.num_tokens)
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    assert got.is_cuda
    _close(got, ref, a.dtype)


def test_the_cpu_and_the_device_agree_in_fp32(tiny_tokenizer):
    cpu = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    gpu = load_model((make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype="float32")
    ids = _ids(50, 7)
    _close(
        gpu.rerotate(_shifted_kv(gpu, ids, 0), 300).keys.cpu(),
        cpu.rerotate(_shifted_kv(cpu, ids, 0), 300).keys,
        torch.float32,
    )
