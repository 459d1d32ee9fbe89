"""ragkv.model.native: the AVX2 int8 kernel against the obvious product of its dequantized weights."""

from __future__ import annotations

import pytest
import torch

from ragkv.model import native
from ragkv.model.quant import quantize_int8, quantized
from tests.conftest import make_model

needs_kernel = pytest.mark.skipif(not native.int8_available(), reason="no C compiler or no AVX2 on this CPU")


def _slow(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scales.double().unsqueeze(1)).t()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize(("out", "inp"), [(4, 8), (7, 13), (64, 96), (130, 200), (33, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_the_dequantized_product(rows, out, inp, threads):
    g = torch.Generator().manual_seed(out * 1000 + inp + rows)
    w = torch.randn(out, inp, generator=g) * torch.linspace(0.1, 4, out).unsqueeze(1)
    q, scales = quantize_int8(w, torch.float32)
    x = torch.randn(rows, inp, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.int8_matmul(x, q, scales)
    finally:
        torch.set_num_threads(before)
    want = _slow(x, q, scales)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    # fp32 sums of `inp` products: a few units of roundoff of the largest partial sum
    magnitude = x.abs().double() @ (q.double().abs() * scales.double().unsqueeze(1)).t()
    bound = 4 * inp * torch.finfo(torch.float32).eps * magnitude
    assert torch.all((got.double() - want).abs() <= bound + 1e-30)


@needs_kernel
def test_bad_operands_are_refused_with_the_shapes():
    q, scales = quantize_int8(torch.randn(8, 16), torch.float32)
    with pytest.raises(ValueError, match="shapes do not agree"):
        native.int8_matmul(torch.randn(1, 15), q, scales)
    with pytest.raises(ValueError, match="int8"):
        native.int8_matmul(torch.randn(1, 16), q.float(), scales)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        native.int8_matmul(torch.randn(1, 16), q, scales.to(torch.bfloat16))


@needs_kernel
def test_int8_decode_copies_compute_with_the_native_kernel_and_fall_back_for_big_batches(tiny_tokenizer):
    model = make_model("qwen2", len(tiny_tokenizer))
    linear = model.model.layers[0].mlp.down_proj
    q, scales = quantize_int8(linear.weight, torch.float32)
    copy = quantized(model, "int8").model.layers[0].mlp.down_proj
    with torch.no_grad():
        small = torch.randn(native.NATIVE_MAX_ROWS, linear.in_features)
        torch.testing.assert_close(copy(small), _slow(small, q, scales).float(), atol=1e-5, rtol=1e-5)
        big = torch.randn(native.NATIVE_MAX_ROWS + 1, linear.in_features)  # torch's kernel: bf16 activations
        want = big.to(torch.bfloat16).float() @ (q.float() * scales.to(torch.bfloat16).float().unsqueeze(1)).t()
        torch.testing.assert_close(copy(big), want, atol=2e-2, rtol=2e-2)


def test_switched_off_the_kernel_is_not_built_and_torch_decodes(tmp_path, monkeypatch):
    monkeypatch.setattr(native.INT8, "_library", [])  # a fresh look, as in a new process
    monkeypatch.setenv("RAGKV_NATIVE_KERNELS", "0")
    monkeypatch.setenv("RAGKV_KERNEL_CACHE", str(tmp_path))
    assert not native.int8_available() and not any(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="not available"):
        native.int8_matmul(torch.randn(1, 16), *quantize_int8(torch.randn(8, 16), torch.float32))


@needs_kernel
def test_the_kernel_is_built_once_into_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_KERNEL_CACHE", str(tmp_path / "k"))
    first = native.INT8.build(native._compiler() or "cc")
    stamp = first.stat().st_mtime_ns
    assert native.INT8.build(native._compiler() or "cc") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "k").iterdir()] == [first.name] and first.suffix == ".so"


@needs_kernel
def test_the_profiler_sees_the_kernels_calls_by_name():
    q, scales = quantize_int8(torch.randn(8, 16), torch.float32)
    kernel, x = native.int8_kernel(q, scales), torch.randn(2, 16)
    with torch.profiler.profile() as prof:
        kernel(x)
        kernel(x)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(native.PROFILED_NAME) == 2
    torch.testing.assert_close(kernel(x), _slow(x, q, scales).float())


@needs_kernel
def test_a_damaged_library_in_the_cache_is_built_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_KERNEL_CACHE", str(tmp_path))
    built = native.INT8.build(native._compiler() or "cc")
    built.write_bytes(b"not a shared library")
    monkeypatch.setattr(native.INT8, "_library", [])  # a fresh look, as in a new process
    assert native.int8_available()
    q, scales = quantize_int8(torch.randn(8, 16), torch.float32)
    x = torch.randn(1, 16)
    torch.testing.assert_close(native.int8_matmul(x, q, scales), _slow(x, q, scales).float())
