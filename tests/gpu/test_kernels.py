"""ragkv's Triton kernels against the torch code they replace: bit for bit.

On the CPU they run in Triton's interpreter (Triton is a test dependency; a CPU install of ragkv
runs without it), on CUDA compiled. Placement's re-rotation (:func:`ragkv.gpu.kernels.turn_keys_`)
must give what ``k.copy_(turn_keys(k, cos, sin))`` gives, for every dtype it takes; a model whose
rotation it does not compute keeps torch (the feed's check per model).
"""

from __future__ import annotations

import re

import pytest
import torch

from ragkv.gpu import feed as feed_module
from ragkv.gpu import kernels
from ragkv.gpu.feed import LayerFeed
from ragkv.model import attention as attention_module
from ragkv.model import load_model
from ragkv.model.rotary import turn_keys, turn_tables
from tests.conftest import make_model
from tests.gpu.test_feed import _slow_place
from tests.model.families import FAMILIES

pytest.importorskip("triton")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tables(rows: int, d: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Turn tables ``[1, rows, d]`` fp32 moving keys from positions 5,000+ to 17+ (Llama 3's base)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def at(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.arange(start, start + rows, dtype=torch.float32)[:, None] * inv[None]
        e = torch.cat([f, f], -1)
        return e.cos()[None], e.sin()[None]

    cos_d, sin_d = turn_tables(*at(5000), *at(17))
    return cos_d.to(device), sin_d.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers: unlike ``torch.equal`` on floats, -0 differs from +0 and NaN equals NaN."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _turn_both(dtype: torch.dtype, d: int, rows: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A layer buffer ``[2, 3, rows + 40, d]`` turned at slots 11..11+rows of its second layer, by the
    kernel and by torch (as the feed turns them on CUDA: the keys as stored). Some keys are +0 and
    -0 (a product with a negative table entry is then -0 in torch)."""
    gen = torch.Generator().manual_seed(rows * 7 + d)
    buf = torch.randn((2, 3, rows + 40, d), generator=gen) * 6
    buf[:, :, ::5, ::3] = 0.0
    buf[:, :, 2::5, 1::3] = -0.0
    buf = buf.to(dtype).to(device)
    cos_d, sin_d = _tables(rows, d, device)
    want = buf.clone()
    view = want[1:2, :, 11 : 11 + rows]
    view.copy_(turn_keys(view, cos_d, sin_d))
    got = buf.clone()
    k = got[1:2, :, 11 : 11 + rows]
    assert kernels.fits(k, cos_d, sin_d)
    kernels.turn_keys_(k, cos_d, sin_d)
    return got, want


@pytest.mark.parametrize("rows", [1, 31, 33, 130])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_kernel_turns_keys_in_place_bit_for_bit_as_torch_does(dtype, d, rows):
    got, want = _turn_both(dtype, d, rows)
    assert torch.equal(_bits(got), _bits(want))  # the turned slots, and every other slot left as it was


def test_the_comparison_sees_the_rounding_the_kernel_must_match():
    """Controls: the data above tells torch's rounding apart from truncation (what Triton's interpreter
    does converting floats to bf16), from one fused multiply-add (what a GPU compiler contracts to;
    the interpreter never contracts, so the PTX test below checks the launch's options), and +0 from
    -0 (compared as bits). Compiled, Triton's ``-x`` is ``0 - x``, which loses a -0; the interpreter
    negates exactly, so only the CUDA test can catch that form, which the kernel does not use."""
    rows, d = 40, 128
    got, want = _turn_both(torch.bfloat16, d, rows)
    assert (_bits(want) == -32768).any()  # some -0 in torch's result: a sign test, not only values'

    rows, d = 130, 128
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn((1, 3, rows, d), generator=gen) * 6).to(torch.bfloat16)
    cos_d, sin_d = _tables(rows, d)
    exact = turn_keys(k.float(), cos_d, sin_d)
    want = exact.to(torch.bfloat16)
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(truncated, want)
    x1, x2 = k.double().chunk(2, -1)
    c1, c2 = cos_d.double().chunk(2, -1)
    s1, s2 = sin_d.double().chunk(2, -1)
    # x * cos rounded to fp32, then added to the other product unrounded: one rounding less
    fused = torch.cat([(x1 * c1).float().double() + -x2 * s1, (x2 * c2).float().double() + x1 * s2], -1).float()
    assert not torch.equal(fused, exact)


def test_fits_says_which_calls_the_kernel_takes():
    cos_d, sin_d = _tables(8, 128)
    k = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    assert kernels.fits(k, cos_d, sin_d)
    assert not kernels.fits(k[..., :96], cos_d[..., :96].contiguous(), sin_d[..., :96].contiguous())  # D/2 not 2^n
    assert not kernels.fits(k.to(torch.int8), cos_d, sin_d)
    assert not kernels.fits(k, cos_d.half(), sin_d)  # tables in fp32 only
    assert not kernels.fits(k, cos_d[..., :64].contiguous(), sin_d[..., :64].contiguous())  # partial rotary
    assert not kernels.fits(k.transpose(-1, -2), cos_d, sin_d)
    with pytest.raises(ValueError, match="turn_keys_ takes"):
        kernels.turn_keys_(k[..., :96], cos_d[..., :96].contiguous(), sin_d[..., :96].contiguous())


def _ptx(bf16: bool, options: dict[str, object]) -> str:
    """The kernel compiled for an H100/H200 (sm_90) on this machine, as a launch from fusion specializes
    it (16-byte aligned pointers, strides multiples of 16, any row count): its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"k_ptr": "*i16" if bf16 else "*fp16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rows": "i32"}
    sig |= {name: "i32" for name in ("head_stride", "row_stride", "table_stride")}
    sig |= {name: "constexpr" for name in ("HALF", "BLOCK", "BF16", "INTERPRET")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5, 6)}
    consts = {"HALF": 64, "BLOCK": kernels._BLOCK, "BF16": bf16, "INTERPRET": False}
    src = ASTSource(fn=kernels._turn_kernel(False), signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_compiled_for_a_gpu_the_kernel_rounds_every_product_and_vectorizes(bf16):
    """The interpreter never fuses a multiply and an add; a GPU compiler does unless told not to. The
    launch's options (``LAUNCH_OPTIONS``) must leave no ``fma`` in the PTX (the control, with fusion
    on, has them), bf16 is rounded by the hardware's conversion to nearest even, and the loads and
    stores are vectorized (they were not while the strides were left unspecialized)."""
    assert kernels._turn_kernel(False).do_not_specialize == ["rows"]  # the launch specializes the strides
    ptx = _ptx(bf16, kernels.LAUNCH_OPTIONS)
    assert "fma." not in ptx and "mul.rn.f32" in ptx and "sub.rn.f32" in ptx
    assert "fma.rn.f32" in _ptx(bf16, {**kernels.LAUNCH_OPTIONS, "enable_fp_fusion": True})
    assert re.search(r"ld\.global(\.\w+)*\.v[24]", ptx) and re.search(r"st\.global(\.\w+)*\.v[24]", ptx)
    if bf16:
        assert "cvt.rn.bf16" in ptx


def test_ragkv_triton_switches_the_kernels_off_and_a_wrong_value_says_so(monkeypatch):
    monkeypatch.delenv("RAGKV_TRITON", raising=False)
    assert kernels.enabled()
    monkeypatch.setenv("RAGKV_TRITON", "0")
    assert not kernels.enabled()
    monkeypatch.setenv("RAGKV_TRITON", "sometimes")
    with pytest.raises(ValueError, match="RAGKV_TRITON must be 1"):
        kernels.enabled()
    monkeypatch.delenv("RAGKV_TRITON")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert not kernels.enabled()


_ROTATIONS = ["llama", "glm4", "olmo2", "ernie4_5", "stablelm", "smollm3"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", _ROTATIONS)
def test_a_feed_with_the_kernel_equals_placing_chunk_by_chunk_for_every_rotation_layout(
    tiny_tokenizer, monkeypatch, family, dtype
):
    """The feed turns keys with the kernel where its check on the model passes (half-split layouts),
    through torch elsewhere; either way its buffer is chunk-by-chunk placement's, bit for bit."""
    monkeypatch.setattr(feed_module, "_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(feed_module, "_turns_as_stored", lambda device: True)  # as on CUDA
    calls = []
    real = kernels.turn_keys_
    monkeypatch.setattr(kernels, "turn_keys_", lambda *a: calls.append(1) or real(*a))
    _, model_type, overrides, _ = next(f for f in FAMILIES if f[0] == family)
    a = load_model((make_model(model_type, len(tiny_tokenizer), **dict(overrides)), tiny_tokenizer), dtype=dtype)
    from tests.core.test_fusion import _prompt

    _, _, _, inp = _prompt(a, sizes=(20, 17, 23, 9))
    checks = len(calls)
    feed = LayerFeed(a, inp.prefix, inp.chunks, extra=3)
    checks = len(calls) - checks  # the check's own call, made once per model
    feed.all_ready()
    want_k, want_v = _slow_place(a, inp, 3)
    assert torch.equal(feed.keys, want_k) and torch.equal(feed.values, want_v)
    used = len(calls) - checks > 0
    assert used == feed._kernel
    if family in ("llama", "smollm3"):  # half-split over every dim: the kernel's layout
        assert used
    if family in ("glm4", "stablelm"):  # interleaved and partial rotary: not the kernel's
        assert not used


def test_a_kernel_that_fails_keeps_torch_and_the_feed_still_places(llama_adapter, monkeypatch, caplog):
    monkeypatch.setattr(feed_module, "_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(feed_module, "_KERNEL_CHECKS", type(feed_module._KERNEL_CHECKS)())

    def broken(*args: object) -> None:
        raise RuntimeError("no compiler for this device")

    monkeypatch.setattr(kernels, "turn_keys_", broken)
    from tests.core.test_fusion import _prompt

    a = llama_adapter
    _, _, _, inp = _prompt(a)
    with caplog.at_level("WARNING", logger="ragkv.gpu.feed"):
        feed = LayerFeed(a, inp.prefix, inp.chunks, extra=2)
    assert not feed._kernel and "through torch" in caplog.text
    feed.all_ready()
    want_k, _ = _slow_place(a, inp, 2)
    assert torch.equal(feed.keys, want_k)


def test_a_kernel_refused_in_a_request_turns_that_run_through_torch_and_later_feeds_too(
    llama_adapter, monkeypatch, caplog
):
    """The check on the model passed, then Triton refuses a call (a shape it did not compile): the run is
    turned through torch, the buffer is still placement's, and the model's later feeds skip the kernel."""
    monkeypatch.setattr(feed_module, "_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(feed_module, "_KERNEL_CHECKS", type(feed_module._KERNEL_CHECKS)())
    from tests.core.test_fusion import _prompt

    a = llama_adapter
    _, _, _, inp = _prompt(a)
    feed = LayerFeed(a, inp.prefix, inp.chunks, extra=2)
    assert feed._kernel  # the check passed

    from triton.runtime.errors import PTXASError  # Triton's errors are not RuntimeErrors

    def refused(*args: object) -> None:
        raise PTXASError("ptxas fatal: Unresolved extern function")

    monkeypatch.setattr(kernels, "turn_keys_", refused)
    with caplog.at_level("WARNING", logger="ragkv.gpu.feed"):
        feed.all_ready()
    assert "from now on" in caplog.text and not feed._kernel
    want_k, want_v = _slow_place(a, inp, 2)
    assert torch.equal(feed.keys, want_k) and torch.equal(feed.values, want_v)
    assert not LayerFeed(a, inp.prefix, inp.chunks)._kernel


def test_switched_off_the_feed_does_not_ask_for_the_kernel(llama_adapter, monkeypatch):
    monkeypatch.setattr(feed_module, "_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("RAGKV_TRITON", "0")
    from tests.core.test_fusion import _prompt

    _, _, _, inp = _prompt(llama_adapter)
    assert not LayerFeed(llama_adapter, inp.prefix, inp.chunks)._kernel


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 33, 515])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_on_cuda_the_kernel_turns_keys_bit_for_bit_as_torch_does(dtype, rows):
    got, want = _turn_both(dtype, 128, rows, "cuda")
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.gpu
@cuda
def test_on_cuda_the_feed_turns_a_llama_models_keys_with_the_kernel_as_torch_does(tiny_tokenizer, monkeypatch):
    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=torch.bfloat16)
    from tests.core.test_fusion import _prompt

    _, _, _, inp = _prompt(a, sizes=(20, 17, 23, 9))
    with_kernel = LayerFeed(a, inp.prefix, inp.chunks, extra=3)
    assert with_kernel._kernel
    with_kernel.all_ready()
    monkeypatch.setenv("RAGKV_TRITON", "0")
    with_torch = LayerFeed(a, inp.prefix, inp.chunks, extra=3)
    assert not with_torch._kernel
    with_torch.all_ready()
    assert torch.equal(_bits(with_kernel.keys), _bits(with_torch.keys))
    assert torch.equal(_bits(with_kernel.values), _bits(with_torch.values))


# --- the question probe's scores scaled and masked in one pass (kernels.scale_mask) ---


def _products_and_mask(dtype: torch.dtype, hkv: int, groups: int, q: int, slots: int, device: str = "cpu"):
    """Half-precision products ``[1, hkv, groups * q, slots]`` (some -0, large values) and the probe's
    causal mask ``[1, 1, q, slots]`` fp32, rows padded as ``causal_mask_at`` pads them."""
    from ragkv.model.masks import causal_mask_at

    gen = torch.Generator().manual_seed(slots + q)
    raw = torch.randn((1, hkv, groups * q, slots), generator=gen) * 40
    raw[..., ::7] = -0.0
    raw[..., 3::7] = 1e-38  # bf16 keeps it; scaled it is subnormal in fp32: a kernel flushing it would differ
    mask = causal_mask_at(torch.arange(slots - q, slots), slots, torch.float32, torch.device(device))
    return raw.to(dtype).to(device), mask


@pytest.mark.parametrize(
    ("hkv", "groups", "q", "slots"), [(2, 4, 5, 300), (1, 2, 32, 2049), (8, 4, 1, 77), (2, 2, 3, 208)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scale_mask_gives_torchs_scaled_masked_scores_bit_for_bit(dtype, hkv, groups, q, slots):
    raw, mask = _products_and_mask(dtype, hkv, groups, q, slots)
    assert mask.stride(2) != slots or slots % 16 == 0  # a padded mask row where slots is not a multiple of 16
    scale = 128**-0.5
    want = (raw.float() * scale).view(1, hkv * groups, q, slots) + mask
    got = kernels.scale_mask(raw, scale, mask)
    assert got.dtype == torch.float32 and got.shape == raw.shape
    assert torch.equal(_bits(got.view(1, hkv * groups, q, slots)), _bits(want))


def test_scale_mask_takes_only_the_calls_it_computes():
    from torch.nn.attention.bias import causal_lower_right

    raw, mask = _products_and_mask(torch.bfloat16, 2, 2, 3, 40)
    assert kernels.scale_mask_fits(raw, mask)
    assert not kernels.scale_mask_fits(raw.float(), mask)  # fp32 products: the CPU's probe
    assert not kernels.scale_mask_fits(raw, mask.bool())
    assert not kernels.scale_mask_fits(raw, mask.half())
    assert not kernels.scale_mask_fits(raw, None)
    assert not kernels.scale_mask_fits(raw, causal_lower_right(3, 40))  # SDPA's bias, a tensor subclass
    assert not kernels.scale_mask_fits(raw[..., :39], mask)
    assert not kernels.scale_mask_fits(raw[:, :, :5], mask)  # rows not a whole number of queries
    with pytest.raises(ValueError, match="scale_mask takes"):
        kernels.scale_mask(raw, 0.1, mask.half())


def test_the_probe_gets_the_kernel_only_on_its_devices_with_triton_on_and_its_check_passed(monkeypatch, caplog):
    monkeypatch.delenv("RAGKV_TRITON", raising=False)
    monkeypatch.setattr(kernels, "_PROBE_CHECKS", {})
    cpu = torch.device("cpu")
    assert kernels.probe_scale_mask(cpu) is None  # a CPU's probe multiplies in fp32 through torch
    monkeypatch.setattr(kernels, "_PROBE_DEVICES", ("cuda", "cpu"))
    fused = kernels.probe_scale_mask(cpu)
    assert fused is not None and kernels._PROBE_CHECKS[cpu]
    raw, mask = _products_and_mask(torch.bfloat16, 1, 2, 3, 20)
    assert fused(raw.float(), 0.5, mask) is None  # a call it does not compute: the probe's torch path
    monkeypatch.setenv("RAGKV_TRITON", "0")
    assert kernels.probe_scale_mask(cpu) is None
    monkeypatch.delenv("RAGKV_TRITON")
    monkeypatch.setattr(kernels, "_PROBE_CHECKS", {})

    def broken(*args: object) -> None:
        raise RuntimeError("no compiler for this device")

    monkeypatch.setattr(kernels, "scale_mask", broken)
    with caplog.at_level("WARNING", logger="ragkv.gpu.kernels"):
        assert kernels.probe_scale_mask(cpu) is None
    assert "through torch" in caplog.text


def test_a_probe_kernel_failing_in_a_request_goes_through_torch_from_then_on(monkeypatch, caplog):
    from triton.runtime.errors import PTXASError

    monkeypatch.setattr(kernels, "_PROBE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(kernels, "_PROBE_CHECKS", {})
    cpu = torch.device("cpu")
    fused = kernels.probe_scale_mask(cpu)
    assert fused is not None  # the check passed

    def refused(*args: object) -> None:
        raise PTXASError("ptxas fatal: Unresolved extern function")

    monkeypatch.setattr(kernels, "scale_mask", refused)
    raw, mask = _products_and_mask(torch.bfloat16, 1, 2, 3, 20)
    with caplog.at_level("WARNING", logger="ragkv.gpu.kernels"):
        assert fused(raw, 0.5, mask) is None  # the probe then scales through torch
    assert "from now on" in caplog.text and kernels.probe_scale_mask(cpu) is None


def test_the_probe_asks_the_kernel_only_for_a_mask_of_one_row_or_of_every_query(monkeypatch):
    """Row ``i`` of a head takes mask row ``i % q``: right for the question's own mask (q rows) or one
    row; another row count would broadcast differently (torch refuses it), so the kernel is not asked."""
    from ragkv.model.attention import AttentionProbe, _probe_attention

    monkeypatch.setattr(attention_module, "_half_products", lambda query: True)
    asked = []

    def spy(raw: torch.Tensor, scale: float, mask: object) -> torch.Tensor | None:
        asked.append(mask.shape[-2])  # type: ignore[attr-defined]
        return None  # torch's path computes it

    gen = torch.Generator().manual_seed(0)
    query = torch.randn((1, 4, 2, 16), generator=gen).to(torch.bfloat16)
    key, value = (torch.randn((1, 2, 10, 16), generator=gen).to(torch.bfloat16) for _ in range(2))
    for rows in (2, 1):
        mask = torch.zeros((1, 1, rows, 10))
        _probe_attention(AttentionProbe(None), 0, query, key, value, mask, None, spy)
    assert asked == [2, 1]
    with pytest.raises(RuntimeError):  # four mask rows for two queries: torch refuses, the kernel is not asked
        _probe_attention(AttentionProbe(None), 0, query, key, value, torch.zeros((1, 1, 4, 10)), None, spy)
    assert asked == [2, 1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_fusion_whose_probe_scales_with_the_kernel_equals_one_through_torch(tiny_tokenizer, monkeypatch, family):
    """The probe's layers replayed (CPU: ``RAGKV_PROBE_GRAPHS=eager``), its products in bf16 and its mask
    fp32 as on a GPU, its scores scaled and masked by the kernel or through torch: the same selection
    and logits, bit for bit."""
    from ragkv.fusion import FusionConfig, FusionInput, fuse
    from ragkv.gpu import graphs
    from ragkv.model import attention
    from ragkv.model.attention import PLAIN

    monkeypatch.setattr(attention, "_half_products", lambda query: query.dtype != torch.float32)
    monkeypatch.setattr(kernels, "_PROBE_CHECKS", {})
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "eager")
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "0")
    a = load_model((make_model(family, len(tiny_tokenizer)), tiny_tokenizer), dtype=torch.bfloat16)
    monkeypatch.setattr(a, "scattered", lambda pos: PLAIN)
    # as under SDPA on CUDA: the question's lower-right causal bias, which the probe makes its fp32 mask
    monkeypatch.setattr(a, "_lower_right_bias_is_free", lambda: True)
    calls = []
    real = kernels.scale_mask
    monkeypatch.setattr(kernels, "scale_mask", lambda *args: calls.append(1) or real(*args))
    from tests.gpu.test_graphs import small_prompt

    prefix, chunks, chunk_ids, question = small_prompt(a)
    out = {}
    try:
        for devices in (("cuda",), ("cuda", "cpu")):
            monkeypatch.setattr(kernels, "_PROBE_DEVICES", devices)
            inp = FusionInput(prefix, chunks, chunk_ids, question)
            out[devices] = fuse(a, inp, FusionConfig(ratio=0.3), prefill_suffix=True)
    finally:
        graphs._MODELS.clear()
    torch_path, kernel_path = out.values()
    assert len(calls) > a.spec.num_layers  # the check's calls, then one a layer
    assert torch.equal(torch_path.selected, kernel_path.selected)
    assert torch.equal(_bits(torch_path.suffix_logits), _bits(kernel_path.suffix_logits))


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_compiled_for_a_gpu_the_probe_kernel_rounds_the_product_and_the_sum_apart(bf16):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(options: dict[str, object], divisible: tuple[int, ...] = (0, 1, 2, 5, 6, 7)) -> str:
        sig = {"s_ptr": "*i16" if bf16 else "*fp16", "m_ptr": "*fp32", "o_ptr": "*fp32", "cols": "i32"}
        sig |= {"queries": "i32", "s_row_stride": "i32", "m_row_stride": "i32", "o_row_stride": "i32"}
        sig |= {"scale": "fp32", "BLOCK": "constexpr", "BF16": "constexpr"}
        attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
        src = ASTSource(
            fn=kernels._scale_mask_kernel(False), signature=sig, constexprs={"BLOCK": 1024, "BF16": bf16}, attrs=attrs
        )
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    code = ptx(kernels.LAUNCH_OPTIONS)
    assert "fma." not in code and "mul.rn.f32" in code and "add.rn.f32" in code
    assert ".ftz" not in code  # subnormal scores kept, as torch keeps them
    assert "fma.rn.f32" in ptx({**kernels.LAUNCH_OPTIONS, "enable_fp_fusion": True})
    # slots a multiple of 16 (a specialized kind: the count is not in do_not_specialize): vectorized
    assert "cols" not in kernels._scale_mask_kernel(False).do_not_specialize
    whole = ptx(kernels.LAUNCH_OPTIONS, divisible=(0, 1, 2, 3, 5, 6, 7))
    assert re.search(r"ld\.global(\.\w+)*\.v[24]", whole) and re.search(r"st\.global(\.\w+)*\.v[24]", whole)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_on_cuda_scale_mask_gives_torchs_scores_bit_for_bit_and_the_probe_takes_it(dtype):
    raw, mask = _products_and_mask(dtype, 8, 4, 32, 16000, "cuda")
    want = (raw.float() * 128**-0.5).view(1, 32, 32, 16000) + mask
    got = kernels.scale_mask(raw, 128**-0.5, mask).view(1, 32, 32, 16000)
    assert torch.equal(_bits(got), _bits(want))
    assert kernels.probe_scale_mask(raw.device) is not None


def test_launches_are_named_for_a_profiler_only_while_one_records():
    """Triton launches run outside any ATen operator: named (``record_function``) while torch's profiler
    records, so that ``experiments/gpu_profile.py`` can tell where their device time went; nothing
    otherwise (``record_function`` costs about 12 us a call even then)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    assert isinstance(kernels.profiled("ragkv::turn_keys_"), contextlib.nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as prof, kernels.profiled("ragkv::turn_keys_"):
        torch.ones(3).add_(1)
    assert any(ev.name == "ragkv::turn_keys_" for ev in prof.events())
