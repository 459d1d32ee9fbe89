"""Triton kernels for fusion's memory-bound passes on a GPU, each checked against the torch code it replaces.

- :func:`turn_keys_`: placement's re-rotation of the moved chunk keys of one layer, in place. Through
  torch it is five passes over the keys (two products, the half swap, the negation, the sum) and a
  copy back, each reading and writing fp32: 20 GB of placement's 25 GB at 16K tokens of
  Llama-3.1-8B's shape (``experiments/gpu_traffic.py``). The kernel reads each key and its tables
  once and writes the key once, with the same arithmetic: bit for bit what torch gives (tested with
  Triton's interpreter on the CPU, against torch on CUDA).

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
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["LAUNCH_OPTIONS", "enabled", "fits", "triton_available", "turn_keys_"]

_BLOCK = 32  # rows of keys per program
# Compile options of every launch: no fused multiply-add, so that each product is rounded to fp32 as
# torch's separate kernels round it (a GPU compiler contracts ``a * b + c`` by default).
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


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
    with on_device:
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
