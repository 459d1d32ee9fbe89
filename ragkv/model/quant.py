"""Weight-only int8 and int4 copies of a model's linear layers, read by decode steps only.

A CPU decode step streams every weight once per token, so its time is the weight bytes over the
memory bandwidth: int8 halves a bf16 step's bytes, int4 quarters them. The copies sit beside the
model's own weights; each linear module's ``forward`` is swapped (once) for one that reads the
copy of the format this thread's step asks for (:func:`step_weights`) and the module's own weight
otherwise, so prefill, fusion, the fingerprint and the state dict never change, and a decoder
reading the model's weights on the same model stays exact.

Formats (torch's CPU kernels):
- ``int8``: symmetric, one scale per output channel (``torch._weight_int8pack_mm``).
- ``int4``: asymmetric, one scale and offset per 32 input columns of a row
  (``torch._weight_int4pack_mm_for_cpu``); the LM head keeps int8 (its 150K rows are the
  logits themselves: 4 bits there cost the most quality per byte saved).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZED", "install", "quantize_int4", "quantize_int8", "step_weights"]

Kernel = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] activations -> [rows, out]

INT4_GROUP = 32  # input columns sharing one int4 scale and offset (Q4_K's sub-block width)
# in_features the kernels handle (torch 2.13, CPU): int8 needs multiples of 16 (24 gave wrong sums,
# 13 a segfault); int4 needs whole groups
_ALIGN = {"int8": 16, "int4": INT4_GROUP}
_STEP: ContextVar[str] = ContextVar("ragkv_step_weights", default="model")
_KERNELS: weakref.WeakKeyDictionary[nn.Module, dict[str, Kernel]] = weakref.WeakKeyDictionary()


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` ``[out, in]``: ``(int8 [out, in], scales [out])``.

    ``weight[o] ~= q[o] * scales[o]``, with ``scales[o] = max|weight[o]| / 127`` (a zero row gets 1).
    """
    w = weight.detach().float()
    peak = w.abs().amax(dim=1)  # [out]
    scales = torch.where(peak > 0, peak / 127.0, torch.ones_like(peak))
    q = torch.round(w / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(scale_dtype)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of ``weight`` ``[out, in]`` per ``group`` input columns: ``(q [out, in] int32 0..15,
    scales_and_zeros [in / group, out, 2] bf16)``, as ``torch._weight_int4pack_mm_for_cpu`` reads them.

    Each group maps its [min, max] onto 0..15: ``w ~= (q - 8) * scale + zero`` with ``zero = min + 8 * scale``.
    """
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-8)  # [out, groups, 1]
    q = torch.round((w - low) / scale).clamp_(0, 15).to(torch.int32).reshape(out, inp)
    zero = low + 8 * scale
    sz = torch.stack([scale.reshape(out, -1).t(), zero.reshape(out, -1).t()], dim=-1)  # [groups, out, 2]
    return q, sz.to(torch.bfloat16).contiguous()


def _int8_kernel(module: nn.Linear, act: torch.dtype) -> Kernel:
    q, scales = quantize_int8(module.weight, act)
    return lambda x: torch._weight_int8pack_mm(x.to(act), q, scales)


def _int4_kernel(module: nn.Linear, act: torch.dtype) -> Kernel:
    q, sz = quantize_int4(module.weight)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, INT4_GROUP, sz)


_MAKERS: dict[str, Callable[[nn.Linear, torch.dtype], Kernel]] = {"int8": _int8_kernel, "int4": _int4_kernel}
QUANTIZED: tuple[str, ...] = tuple(_MAKERS)


def _dispatching_forward(module: nn.Linear, kernels: dict[str, Kernel]) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.get(_STEP.get())
        if kernel is None:
            return plain(x)
        out = kernel(x.reshape(-1, x.shape[-1])).to(x.dtype)  # the kernels take 2-D activations
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def install(model: Any, weights: str) -> int:
    """Give the decoder's linear layers and the LM head ``weights`` copies (once per format); return bytes added.

    On the CPU the kernels are fast for bf16 activations and slow for fp32 ones, so an fp32 model's
    activations go through them in bf16.
    """
    if weights not in _MAKERS:
        raise ValueError(f"quantized decode weights are one of {QUANTIZED}, got {weights!r}")
    act = torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    added = 0
    for module in [*model.model.layers.modules(), model.lm_head]:
        if not isinstance(module, nn.Linear):
            continue
        kernels = _KERNELS.get(module)
        if kernels is None:
            kernels = _KERNELS[module] = {}
            module.forward = _dispatching_forward(module, kernels)  # type: ignore[method-assign,assignment]
        if weights in kernels:
            continue
        fmt = "int8" if module is model.lm_head else weights
        if module.in_features % _ALIGN[fmt]:
            logger.warning(
                "%s decode: a %s keeps its weights (in_features %d)", fmt, type(module).__name__, module.in_features
            )
            continue
        kernels[weights] = _MAKERS[fmt](module, act)
        added += module.weight.numel() // (1 if fmt == "int8" else 2)
    return added


@contextmanager
def step_weights(weights: str) -> Iterator[None]:
    """Within the block, this thread's linear layers read their ``weights`` copies (where installed)."""
    token = _STEP.set(weights)
    try:
        yield
    finally:
        _STEP.reset(token)
