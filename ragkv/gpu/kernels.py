"""Triton kernels for fusion's memory-bound passes on a GPU, each checked against the torch code it replaces.

- :func:`turn_keys_`: placement's re-rotation of the moved chunk keys of one layer, in place. Through
  torch it is five passes over the keys (two products, the half swap, the negation, the sum) and a
  copy back, each reading and writing fp32: 20 GB of placement's 25 GB at 16K tokens of
  Llama-3.1-8B's shape (``experiments/gpu_traffic.py``). The kernel reads each key and its tables
  once and writes the key once, with the same arithmetic: bit for bit what torch gives (tested with
  Triton's interpreter on the CPU, against torch on CUDA).

- :func:`scale_mask`: the question probe's scores of one layer, from the products in the model's
  half-precision dtype to fp32 ``x * scale + mask`` in one pass. Through torch that is three
  (``float()``, the scaling, the mask's addition), each writing fp32: 11.5 of the probe's 23 GB of
  such traffic at 16K, against the kernel's 3.2. The same numbers, bit for bit.

Triton is optional: where it is missing (a CPU install), or ``RAGKV_TRITON=0``, everything runs
through torch as before. A model whose rotation is not the half-split one the kernel computes is
found by a check on the model's own rotation function (:func:`ragkv.gpu.feed.kernel_turns`), once per model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "LAUNCH_OPTIONS",
    "enabled",
    "fits",
    "profiled",
    "probe_scale_mask",
    "scale_mask",
    "scale_mask_fits",
    "triton_available",
    "turn_keys_",
]

_BLOCK = 32  # rows of keys per program
# Compile options of every launch: no fused multiply-add, so that each product is rounded to fp32 as
# torch's separate kernels round it (a GPU compiler contracts ``a * b + c`` by default).
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


def profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """A Triton launch named ``name`` for torch's profiler, while one records: launches run outside any
    ATen operator, and ``experiments/gpu_profile.py`` counts device time by the operator that launched
    it. Nothing otherwise (``record_function`` costs about 12 us a call even with no profiler)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA builds, not with its CPU ones)."""
    return importlib.util.find_spec("triton") is not None


def enabled() -> bool:
    """Whether ragkv's Triton kernels may run: Triton installed and ``RAGKV_TRITON`` not ``0`` (read each call)."""
    raw = os.environ.get("RAGKV_TRITON", "1").strip().lower()
    if raw not in ("0", "1", "off", "on", "false", "true"):
        raise ValueError(f"RAGKV_TRITON must be 1 (use ragkv's Triton kernels where they apply) or 0, got {raw!r}")
    return raw in ("1", "on", "true") and triton_available()


@functools.cache
def _turn_kernel(interpret: bool) -> Any:
    """The jitted kernel: compiled for the GPU, or run by Triton's interpreter (a CPU's tensors: tests)."""
    import triton
    from triton import knobs

    from ragkv.gpu._triton_turn import turn_half_split

    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        # no specialization on the row count (each value class would compile a kernel of its own in the
        # middle of a request). The strides are specialized: multiples of 16 wherever fusion calls it
        # (head_dim times a count; the check's too), and known so, the loads and stores are vectorized
        return triton.jit(turn_half_split, do_not_specialize=["rows"])


@functools.cache
def _scale_mask_kernel(interpret: bool) -> Any:
    """:func:`scale_mask`'s jitted kernel (as :func:`_turn_kernel`)."""
    import triton
    from triton import knobs

    from ragkv.gpu._triton_probe import scale_mask as source

    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        # The slots (and the products' row strides, the same count) are specialized: a count that is a
        # multiple of 16 lets the loads and stores vectorize; the two kinds are compiled by the check
        # (_check_scale_mask). The question's length is not (1 would be a kind of its own), nor the scale.
        return triton.jit(source, do_not_specialize=["queries", "scale"])


def scale_mask_fits(raw: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`scale_mask` computes this call: products ``raw`` ``[1, kv_heads, rows, slots]`` in
    bf16 or fp16 with unit stride along the slots, and an fp32 additive mask ``[1, 1, q, slots]``
    (unit stride along the slots) whose ``q`` divides the rows, on ``raw``'s device."""
    if type(mask) is not torch.Tensor or raw.dim() != 4 or raw.shape[0] != 1 or mask.dim() != 4:
        return False  # a tensor subclass (SDPA's CausalBias) is not a mask tensor
    if raw.dtype not in (torch.bfloat16, torch.float16) or mask.dtype != torch.float32 or mask.device != raw.device:
        return False
    q, slots = mask.shape[2], mask.shape[3]
    if mask.shape[:2] != (1, 1) or raw.shape[3] != slots or q == 0 or raw.shape[2] % q or slots == 0:
        return False
    return raw.stride(3) == 1 and mask.stride(3) == 1 and raw.stride(1) == raw.shape[2] * raw.stride(2)


def scale_mask(raw: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """``raw.float() * scale + mask``: products ``[1, kv_heads, rows, slots]`` (each head's rows its
    queries in order, repeated per query head of the group) and the mask ``[1, 1, q, slots]`` shared
    by every head, as a new fp32 tensor of ``raw``'s shape; bit for bit torch's result. Call only
    where :func:`scale_mask_fits` says so. On a CPU tensor it runs in Triton's interpreter (tests)."""
    import triton

    if not scale_mask_fits(raw, mask):
        got = f"{tuple(raw.shape)} {raw.dtype} and {tuple(mask.shape)} {mask.dtype}"
        raise ValueError(
            f"scale_mask takes [1, kv_heads, rows, slots] half products, a [1, 1, q, slots] fp32 mask; {got}"
        )
    rows, slots = raw.shape[1] * raw.shape[2], raw.shape[3]
    out = torch.empty(raw.shape, dtype=torch.float32, device=raw.device)
    bf16 = raw.dtype == torch.bfloat16
    interpret = raw.device.type != "cuda"
    block = 1024
    on_device = torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext()
    with on_device, profiled("ragkv::scale_mask"):
        _scale_mask_kernel(interpret)[(rows, triton.cdiv(slots, block))](
            raw.view(torch.int16) if bf16 else raw,
            mask,
            out,
            slots,
            mask.shape[2],
            raw.stride(2),
            mask.stride(2),
            out.stride(2),
            float(scale),
            BLOCK=block,
            BF16=bf16,
            **LAUNCH_OPTIONS,
        )
    return out


# Devices whose question probe may scale and mask its scores with the kernel (the tests add "cpu").
_PROBE_DEVICES: tuple[str, ...] = ("cuda",)
_PROBE_CHECKS: dict[torch.device, bool] = {}
_PROBE_LOCK = threading.Lock()


def probe_scale_mask(device: torch.device) -> Callable[[torch.Tensor, float, Any], torch.Tensor | None] | None:
    """:func:`scale_mask` as the probe's ``scale_mask`` on ``device`` (``ragkv.model.attention``), taking
    only the calls it computes; None where it does not run there: not a GPU, Triton missing or
    switched off (``RAGKV_TRITON=0``), or its check on the device failed (:func:`_check_scale_mask`,
    once per device)."""
    if device.type not in _PROBE_DEVICES or not enabled():
        return None
    with _PROBE_LOCK:
        ok = _PROBE_CHECKS.get(device)
        if ok is None:
            ok = _PROBE_CHECKS[device] = _check_scale_mask(device)
    if not ok:
        return None

    def fused(raw: torch.Tensor, scale: float, mask: Any) -> torch.Tensor | None:
        if not scale_mask_fits(raw, mask):
            return None
        try:
            return scale_mask(raw, scale, mask)
        except Exception as e:  # Triton's own errors included: this call and later ones go through torch
            logger.warning(
                "ragkv's Triton probe kernel failed (%s): the probe scales its scores through torch from now on", e
            )
            with _PROBE_LOCK:
                _PROBE_CHECKS[device] = False
            return None

    return fused


def _check_scale_mask(device: torch.device) -> bool:
    """The kernel against torch on ``device``, bf16 and fp16 products with some -0, a causal mask: True
    where every bit agrees; False (logged) where it differs or fails to compile or run."""
    from ragkv.model.masks import causal_mask_at

    gen = torch.Generator().manual_seed(0)
    q = 3
    # slots a multiple of 16 and not: the kernel's two compiled kinds, both compiled here
    for dtype, slots in ((torch.bfloat16, 203), (torch.bfloat16, 208), (torch.float16, 203), (torch.float16, 208)):
        mask = causal_mask_at(torch.arange(slots - q, slots), slots, torch.float32, device)
        raw = torch.randn((1, 2, 2 * q, slots), generator=gen) * 40
        raw[..., ::9] = -0.0
        raw[..., 1::9] = 1e-38  # subnormal once scaled: a kernel flushing them would differ
        raw = raw.to(dtype).to(device)
        want = (raw.float() * 0.088388).view(1, 4, q, slots) + mask
        try:
            got = scale_mask(raw, 0.088388, mask).view(1, 4, q, slots)
        except Exception as e:  # a Triton that cannot compile for this device, say: torch scales the scores
            logger.warning(
                "ragkv's Triton probe kernel failed on %s (%s): the probe scales its scores through torch", device, e
            )
            return False
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            logger.info(
                "ragkv's Triton probe kernel differs from torch on %s: the probe scales its scores through torch",
                device,
            )
            return False
    return True


def fits(k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor) -> bool:
    """Whether :func:`turn_keys_` computes this call: keys ``[1, heads, rows, D]`` in bf16, fp16 or fp32
    with unit stride along ``D`` (``D / 2`` a power of two), tables ``[1, rows, D]`` fp32 contiguous
    on the keys' device (a rotation over every dim: partial rotary goes through torch)."""
    if k.dim() != 4 or k.shape[0] != 1 or k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    rows, d = k.shape[2], k.shape[3]
    half = d // 2
    if rows == 0 or d % 2 or half & (half - 1) or k.stride(-1) != 1:
        return False
    for t in (cos_d, sin_d):
        if t.shape != (1, rows, d) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != k.device:
            return False
    return True


def turn_keys_(k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor) -> None:
    """Turn keys ``k`` ``[1, heads, rows, D]`` in place by the fp32 tables ``[1, rows, D]`` (half-split
    RoPE pairing): ``k * cos + rotate_half(k) * sin`` in fp32, rounded to ``k``'s dtype, as
    ``k.copy_(ragkv.model.rotary.turn_keys(k, cos_d, sin_d))`` computes it on CUDA. Call only where
    :func:`fits` says so. On a CPU tensor it runs in Triton's interpreter (slow: tests only)."""
    import triton

    if not fits(k, cos_d, sin_d):
        raise ValueError(f"turn_keys_ takes [1, heads, rows, D] keys and [1, rows, D] fp32 tables; got {k.shape}")
    heads, rows, d = k.shape[1], k.shape[2], k.shape[3]
    bf16 = k.dtype == torch.bfloat16
    target = k.view(torch.int16) if bf16 else k  # bf16 as its bits: see ragkv.gpu._triton_turn
    interpret = k.device.type != "cuda"
    kernel = _turn_kernel(interpret)
    # Triton launches on the current device: the keys' (a model on cuda:1 while cuda:0 is current)
    on_device = torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext()
    with on_device, profiled("ragkv::turn_keys_"):
        kernel[(heads, triton.cdiv(rows, _BLOCK))](
            target,
            cos_d,
            sin_d,
            rows,
            k.stride(1),
            k.stride(2),
            cos_d.stride(1),
            HALF=d // 2,
            BLOCK=_BLOCK,
            BF16=bf16,
            INTERPRET=interpret,
            **LAUNCH_OPTIONS,
        )
