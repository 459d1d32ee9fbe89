"""The recompute's attention from the rows' positions (``ragkv.gpu.attention``) against SDPA with the mask.

On the CPU the kernel runs in Triton's interpreter (bf16 products there on fp32 copies of the same
values: the interpreter computes bf16 products wrong); on CUDA compiled. A flash kernel orders its
sums by tile, so it is within rounding of SDPA's output, not bit for bit: every comparison bounds
its error against an fp32 reference by twice SDPA's own error on the same half-precision inputs
(plus one ulp of the output's scale), and a control shows the bound catches a mask off by one slot.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ragkv.fusion import FusedContext
from ragkv.gpu import attention as gattn
from ragkv.model import attention as attention_module
from ragkv.model import load_model
from ragkv.model.attention import PLAIN, Steer
from ragkv.model.masks import PositionMask
from tests.conftest import make_model

pytest.importorskip("triton")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    rows: int,
    slots: int,
    device: str = "cpu",
    seed: int = 0,
    order: str = "scattered",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[1, hq, rows, d]`` (a transposed ``[1, rows, hq, d]``, as a model's are), keys and values
    ``[1, hkv, slots, d]`` inside a longer buffer, and positions: ``scattered`` (in no order, the first
    and last slot among them) or as a recompute has them (``sorted``, distinct: a tile's walk over the
    keys ends at its last row's, after one or two steps for the first tiles)."""
    gen = torch.Generator().manual_seed(seed)
    if order == "sorted":
        pos = torch.sort(torch.randperm(slots, generator=gen)[:rows]).values
    else:
        pos = torch.randint(0, slots, (rows,), generator=gen)
        pos[0] = slots - 1
        if rows > 1:
            pos[rows // 2] = 0
    q = (torch.randn((1, rows, hq, d), generator=gen) * 2).to(dtype).to(device).transpose(1, 2)
    buf = torch.randn((2, 1, hkv, slots + 19, d), generator=gen).to(dtype).to(device)
    return q, buf[0, :, :, :slots], buf[1, :, :, :slots], pos.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (2, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize(("rows", "slots"), [(1, 33), (17, 150), (40, 77)])
@pytest.mark.parametrize("order", ["scattered", "sorted"])
def test_the_kernel_is_within_rounding_of_sdpa_with_the_exact_mask(dtype, hq, hkv, d, rows, slots, order):
    q, k, v, pos = _inputs(dtype, hq, hkv, d, rows, slots, order=order)
    got = gattn.position_attention(q, k, v, pos)
    assert got.shape == (1, rows, hq, d) and got.dtype == dtype and got.is_contiguous()
    assert gattn.rounding_excess(got, q, k, v, pos) <= 1


@pytest.mark.parametrize(
    "wrong",
    ["one slot more", "the last slot unseen", "the last key tile dropped", "another key head"],
)
def test_the_bound_catches_a_kernel_that_is_wrong_by_a_little(wrong):
    """Controls: the same bound fails a kernel whose rows see one slot more, whose last row misses its
    own slot, whose walk stops a tile early, or which reads the neighbouring key head."""
    q, k, v, pos = _inputs(torch.bfloat16, 4, 2, 64, 24, 90, order="sorted")
    if wrong == "one slot more":
        got = gattn.position_attention(q, k, v, (pos + 1).clamp_max(89))
    elif wrong == "the last slot unseen":
        cut = pos.clone()
        cut[-1] -= 1
        got = gattn.position_attention(q, k, v, cut)
    elif wrong == "the last key tile dropped":
        got = gattn.position_attention(q, k, v, pos.clamp_max(int(pos.max()) // 16 * 16 - 1))
    else:
        got = gattn.position_attention(q, k.roll(1, dims=1), v.roll(1, dims=1), pos)
    assert gattn.rounding_excess(got, q, k, v, pos) > 2


def test_a_scale_is_applied_as_sdpa_applies_it():
    q, k, v, pos = _inputs(torch.float16, 4, 2, 64, 9, 40)
    got = gattn.position_attention(q, k, v, pos, 0.3)
    want = gattn.masked_reference(q.float(), k.float(), v.float(), pos, 0.3)
    assert (got.float() - want).abs().max().item() < 5e-3


def test_no_rows_give_an_empty_output():
    q, k, v, pos = _inputs(torch.bfloat16, 4, 2, 64, 3, 20)
    out = gattn.position_attention(q[:, :, :0], k, v, pos[:0])
    assert out.shape == (1, 0, 4, 64)


def test_fits_refuses_what_the_kernel_does_not_compute():
    q, k, v, pos = _inputs(torch.bfloat16, 4, 2, 64, 5, 20)
    assert gattn.fits(q, k, v, pos)
    assert not gattn.fits(q.float(), k.float(), v.float(), pos)  # fp32: its products would run in tf32
    assert not gattn.fits(q, k.half(), v.half(), pos)
    assert not gattn.fits(q[..., :48], k[..., :48], v[..., :48], pos)  # D 48
    assert not gattn.fits(q[:, :3], k, v, pos)  # 3 query heads over 2 key heads
    assert not gattn.fits(q, k, v, pos.to(torch.int32))
    assert not gattn.fits(q, k, v, pos[:4])
    assert not gattn.fits(q, k.transpose(-1, -2), v, pos)
    assert not gattn.fits(torch.cat([q, q]), k, v, pos)  # a batch of two
    with pytest.raises(ValueError, match="position_attention takes"):
        gattn.position_attention(q.float(), k.float(), v.float(), pos)


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(gattn, "_CHOICES", {})
    monkeypatch.delenv("RAGKV_TRITON", raising=False)
    monkeypatch.delenv(gattn.ENV, raising=False)


def _adapter(tiny_tokenizer, family: str = "llama", dtype: torch.dtype = torch.bfloat16):
    return load_model((make_model(family, len(tiny_tokenizer), head_dim=64), tiny_tokenizer), dtype=dtype)


def test_fusion_gets_the_kernel_only_on_its_devices_switched_on_and_checked(tiny_tokenizer, monkeypatch, fresh_choices):
    a = _adapter(tiny_tokenizer)
    assert gattn.attention_kernel(a) is None  # a CPU is not among its devices
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    assert callable(gattn.attention_kernel(a))
    monkeypatch.setenv(gattn.ENV, "0")
    assert gattn.attention_kernel(a) is None
    monkeypatch.setenv(gattn.ENV, "on")
    monkeypatch.setenv("RAGKV_TRITON", "0")
    assert gattn.attention_kernel(a) is None
    monkeypatch.delenv("RAGKV_TRITON")
    monkeypatch.setenv(gattn.ENV, "sometimes")
    with pytest.raises(ValueError, match=re.escape("RAGKV_ATTENTION_KERNEL must be auto")):
        gattn.attention_kernel(a)
    monkeypatch.setenv(gattn.ENV, "1")
    assert gattn.attention_kernel(_adapter(tiny_tokenizer, dtype=torch.float32)) is None  # fp32 keeps torch


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_auto_keeps_the_kernel_only_where_it_was_faster_than_sdpa(
    tiny_tokenizer, monkeypatch, fresh_choices, caplog, kernel_faster
):
    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    timed = []

    def seconds(fn, device, repeats=5):  # the interpreter's speed says nothing: each side's time is given
        kernel = isinstance(fn, functools.partial) and fn.func is gattn.position_attention
        timed.append("kernel" if kernel else "sdpa")
        return (1.0 if kernel else 2.0) if kernel_faster else (2.0 if kernel else 1.0)

    monkeypatch.setattr(gattn, "_seconds", seconds)
    monkeypatch.setattr(gattn, "_TIMING_SHAPES", ((20, 64), (40, 160)))  # the interpreter is slow
    with caplog.at_level("INFO", logger="ragkv.gpu.attention"):
        got = gattn.attention_kernel(a)
    assert sorted(timed) == ["kernel", "kernel", "sdpa", "sdpa"]  # each of the two shapes, each way
    assert (got is not None) == kernel_faster
    assert ("uses the kernel" if kernel_faster else "stays with torch") in caplog.text
    gattn.attention_kernel(a)
    assert len(timed) == 4  # decided once


def test_a_kernel_failing_its_check_keeps_torch(tiny_tokenizer, monkeypatch, fresh_choices, caplog):
    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    real = gattn.position_attention

    def off_by_one(q, k, v, pos, scale=None, config=None):
        return real(q, k, v, (pos + 1).clamp_max(k.shape[2] - 1), scale, config)

    monkeypatch.setattr(gattn, "position_attention", off_by_one)
    with caplog.at_level("INFO", logger="ragkv.gpu.attention"):
        assert gattn.attention_kernel(a) is None
    assert "is off by" in caplog.text

    def broken(*args, **kwargs):
        from triton.runtime.errors import PTXASError  # Triton's errors are not RuntimeErrors

        raise PTXASError("ptxas fatal: out of resources")

    monkeypatch.setattr(gattn, "_CHOICES", {})
    monkeypatch.setattr(gattn, "position_attention", broken)
    assert gattn.attention_kernel(a) is None
    assert "ptxas fatal" in caplog.text


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB"),
        RuntimeError("Triton Error [CUDA]: out of memory"),  # Triton's (and cuBLAS') are RuntimeErrors
    ],
    ids=["torch", "triton"],
)
def test_a_choice_out_of_device_memory_keeps_torch_and_is_tried_again_30_s_later(
    tiny_tokenizer, monkeypatch, fresh_choices, caplog, error
):
    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gattn, "_OOM_UNTIL", {})
    monkeypatch.setenv(gattn.ENV, "1")
    now = [1000.0]
    monkeypatch.setattr(gattn, "_now", lambda: now[0])
    tries = []

    def out_of_memory(*args):
        tries.append(1)
        raise error

    monkeypatch.setattr(gattn, "_choose", out_of_memory)
    assert gattn.attention_kernel(a) is None and gattn.attention_kernel(a) is None
    assert len(tries) == 1 and "tried again in 30 s" in caplog.text  # not at every step
    now[0] += 29.0
    assert gattn.attention_kernel(a) is None and len(tries) == 1
    now[0] += 2.0
    monkeypatch.setattr(gattn, "_choose", lambda *args: gattn._INTERPRETED)
    assert gattn.attention_kernel(a) is not None  # 30 s on: checked again


def test_a_choice_that_fails_otherwise_keeps_torch_for_good(tiny_tokenizer, monkeypatch, fresh_choices, caplog):
    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    tries = []

    def fails(*args):
        tries.append(1)
        raise RuntimeError("CUDA error: misaligned address")

    monkeypatch.setattr(gattn, "_choose", fails)
    assert gattn.attention_kernel(a) is None and gattn.attention_kernel(a) is None
    assert len(tries) == 1 and "could not be checked" in caplog.text


def test_while_one_thread_makes_the_choice_others_go_through_torch(tiny_tokenizer, monkeypatch, fresh_choices):
    import threading

    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    started, release = threading.Event(), threading.Event()

    def slow(*args):
        started.set()
        release.wait(30)
        return gattn._INTERPRETED

    monkeypatch.setattr(gattn, "_choose", slow)
    got = []
    chooser = threading.Thread(target=lambda: got.append(gattn.attention_kernel(a)))
    chooser.start()
    assert started.wait(30)
    assert gattn.attention_kernel(a) is None  # not waiting for it
    release.set()
    chooser.join(30)
    assert got and got[0] is not None and gattn.attention_kernel(a) is not None


def test_the_kernel_takes_only_the_head_layout_it_was_checked_for(tiny_tokenizer, monkeypatch, fresh_choices):
    a = _adapter(tiny_tokenizer)  # 4 query heads over 2, D 64
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    run = gattn.attention_kernel(a)
    assert run is not None
    assert run(*_inputs(torch.bfloat16, 4, 2, 64, 5, 20), None) is not None
    assert run(*_inputs(torch.bfloat16, 8, 2, 64, 5, 20), None) is None
    assert run(*_inputs(torch.bfloat16, 4, 2, 128, 5, 20), None) is None


def test_a_kernel_failing_in_a_request_sends_that_call_and_later_ones_through_torch(
    tiny_tokenizer, monkeypatch, fresh_choices, caplog
):
    a = _adapter(tiny_tokenizer)
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(gattn.ENV, "1")
    run = gattn.attention_kernel(a)
    q, k, v, pos = _inputs(torch.bfloat16, 4, 2, 64, 5, 20)
    assert run is not None and run(q, k, v, pos, None) is not None

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(gattn, "position_attention", broken)
    assert run(q, k, v, pos, None) is None
    assert "fusion's attention goes through torch" in caplog.text
    assert gattn.attention_kernel(a) is None  # later passes get no kernel


def test_the_mask_keeps_a_kernel_only_for_positions_inside_the_slots():
    kernel = lambda *args: None  # noqa: E731
    inside = PositionMask(torch.tensor([0, 5, 9]), 10, torch.bfloat16, torch.device("cpu"), kernel=kernel)
    assert inside.kernel is kernel
    outside = PositionMask(torch.tensor([0, 5, 10]), 10, torch.bfloat16, torch.device("cpu"), kernel=kernel)
    assert outside.kernel is None
    assert outside.device_positions().dtype == torch.int64


def test_the_dispatcher_asks_the_kernel_only_for_a_plain_pass_and_falls_back_when_it_declines():
    """The kernel gets a prefill pass's call over exactly the mask's rows and slots; a probe, decode rows
    riding along, a window, dropout, positional arguments or another row count do not get it. A kernel that
    returns None leaves the call to the mask's path, whose output is what SDPA with the mask gives."""
    q, k, v, pos = _inputs(torch.bfloat16, 4, 2, 64, 6, 30)
    asked: list[int] = []
    answer: list[torch.Tensor | None] = [None]

    def kernel(query, key, value, positions, scale):
        asked.append(query.shape[2])
        assert torch.equal(positions, pos)
        return answer[0]

    mask = PositionMask(pos.cpu(), 30, torch.bfloat16, torch.device("cpu"), device_pos=pos, kernel=kernel)
    fn = attention_module._dispatcher("sdpa")
    module = type("Attn", (), {"num_key_value_groups": 2, "is_causal": True, "layer_idx": 0})()
    steer = Steer(kind="prefill")  # no query_pos: the CPU's native kernel stays out of it
    out, _ = fn(module, q, k, v, mask, ragkv_steer=steer, scaling=None)
    assert asked == [6]
    want = gattn.masked_reference(q, k, v, pos)
    assert torch.equal(out, want)  # declined: the mask's path
    answer[0] = torch.full((1, 6, 4, 64), 7.0, dtype=torch.bfloat16)
    out, _ = fn(module, q, k, v, mask, ragkv_steer=steer, scaling=None)
    assert out is answer[0]
    for kwargs in ({"sliding_window": 8}, {"dropout": 0.1}):  # (SDPA itself refuses soft-capping)
        fn(module, q, k, v, mask, ragkv_steer=steer, scaling=None, **kwargs)
    assert not attention_module._plain_call(steer, mask, q[:, :, :5], k, {})  # rows the mask was not made for
    fn(module, q, k, v, mask, 0.0, ragkv_steer=steer)  # a positional argument (dropout) it would drop
    fn(module, q, k, v, mask, ragkv_steer=Steer(kind="decode"), scaling=None)
    assert asked == [6, 6]


def _two_fusions(a, monkeypatch, use: Callable[[int], None]) -> tuple[FusedContext, FusedContext, int]:
    """``small_prompt``'s fusion after ``use(0)`` (the kernel off) and after ``use(1)`` (on), and how many
    calls the kernel got."""
    from ragkv.fusion import FusionConfig, FusionInput, fuse
    from ragkv.gpu import graphs
    from tests.gpu.test_graphs import small_prompt

    calls = []
    real = gattn.position_attention

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(gattn, "position_attention", counted)
    prefix, chunks, chunk_ids, question = small_prompt(a)
    out = []
    try:
        for on in (0, 1):
            use(on)
            out.append(
                fuse(a, FusionInput(prefix, chunks, chunk_ids, question), FusionConfig(ratio=0.3), prefill_suffix=True)
            )
    finally:
        graphs._MODELS.clear()
    return out[0], out[1], len(calls)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("graphs_setting", ["0", "eager"], ids=["layers", "replayed"])
def test_a_fusion_through_the_kernel_selects_as_one_through_torch(tiny_tokenizer, monkeypatch, family, graphs_setting):
    """The recompute's attention by the kernel or by SDPA with the mask (fp16, head dim 64; through the
    model's layers or its replayed parts): the same tokens selected, the logits within rounding."""
    monkeypatch.setattr(gattn, "_CHOICES", {})
    monkeypatch.setenv(gattn.ENV, "1")
    monkeypatch.delenv("RAGKV_TRITON", raising=False)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", graphs_setting)
    a = _adapter(tiny_tokenizer, family, torch.float16)
    monkeypatch.setattr(a, "scattered", lambda pos: PLAIN)  # the GPU's path: no native CPU kernel
    monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu"))
    assert gattn.attention_kernel(a) is not None  # checked before the calls are counted
    torch_path, kernel_path, calls = _two_fusions(
        a, monkeypatch, lambda on: monkeypatch.setattr(gattn, "_DEVICES", ("cuda", "cpu") if on else ("cuda",))
    )
    assert calls >= a.spec.num_layers  # every recompute layer's attention
    assert torch.equal(torch_path.selected, kernel_path.selected)
    torch.testing.assert_close(kernel_path.suffix_logits, torch_path.suffix_logits, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kernel_path.cache.layers[1].keys, torch_path.cache.layers[1].keys, atol=2e-2, rtol=2e-2)


def _compiled(config: gattn.Config, d: int, group: int) -> object:
    """The kernel compiled for an H100/H200 (sm_90) on this machine, as a launch from fusion specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = ("q_ptr", "k_ptr", "v_ptr", "pos_ptr", "o_ptr")
    sig = {n: "*bf16" for n in names} | {"pos_ptr": "*i64", "rows": "i32"}
    strides = ("q_head_stride", "q_row_stride", "k_head_stride", "k_row_stride", "v_head_stride", "v_row_stride")
    sig |= {n: "i32" for n in (*strides, "o_row_stride")} | {"scale": "fp32"}
    consts = {
        "GROUP": group,
        "D": d,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "INTERPRET": False,
        "WIDEN": False,
    }
    sig |= {n: "constexpr" for n in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12)}
    src = ASTSource(fn=gattn._kernel(False), signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.parametrize("config", gattn._CUDA_CONFIGS, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_every_gpu_tiling_compiles_for_an_h100_on_tensor_cores_within_its_shared_memory(config, d):
    """Each tiling the choice may time, compiled for sm_90 here: its products on tensor cores, and the
    shared memory it asks for within an H100's 227 KiB a block (a launch asking more fails)."""
    compiled = _compiled(config, d, group=4)
    ptx = compiled.asm["ptx"]
    assert re.search(r"\b(wgmma|mma)\.", ptx)
    assert compiled.metadata.shared <= 227 * 1024


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", gattn._CUDA_CONFIGS, ids=str)
def test_on_cuda_the_kernel_is_within_rounding_of_sdpa(dtype, config):
    """Llama-3.1-8B's heads (32 over 8, D 128), 700 rows spread over 3,000 slots: every tiling."""
    for order in ("scattered", "sorted"):
        q, k, v, pos = _inputs(dtype, 32, 8, 128, 700, 3000, device="cuda", order=order)
        assert gattn.rounding_excess(gattn.position_attention(q, k, v, pos, None, config), q, k, v, pos) <= 1


@cuda
@pytest.mark.gpu
def test_on_cuda_a_fusion_through_the_kernel_selects_as_one_through_torch(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(gattn, "_CHOICES", {})
    monkeypatch.delenv("RAGKV_TRITON", raising=False)
    model = make_model("llama", len(tiny_tokenizer), head_dim=64)
    a = load_model((model, tiny_tokenizer), dtype=torch.bfloat16, device="cuda")
    monkeypatch.setenv(gattn.ENV, "1")
    assert gattn.attention_kernel(a) is not None  # its check passed on this device
    torch_path, kernel_path, calls = _two_fusions(a, monkeypatch, lambda on: monkeypatch.setenv(gattn.ENV, str(on)))
    assert calls >= a.spec.num_layers  # the recompute's layers went through the kernel
    assert torch.equal(torch_path.selected, kernel_path.selected)
    torch.testing.assert_close(kernel_path.suffix_logits, torch_path.suffix_logits, atol=5e-2, rtol=5e-2)
