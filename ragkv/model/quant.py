"""Weight-only int8 and int4 copies of a model's linear layers, read by decode steps only.

A CPU decode step streams every weight once per token, so its time is the weight bytes over the
memory bandwidth: int8 halves a bf16 step's bytes, int4 quarters them. :func:`quantized` makes
(once per model and format) a copy of the model that shares every module and parameter with it
except the decoder's linear layers and the LM head, which read the quantized copies; a decode
step asking for those weights (``Steer(weights="int8")``) runs that copy's layers, every other
pass runs the model itself, so prefill, fusion, the fingerprint and the state dict never change,
and a decoder reading the model's weights on the same model stays exact. (Until issue 32 the
linear modules' ``forward`` was swapped for one that read the format from a ContextVar.)

Formats (torch's CPU kernels):
- ``int8``: symmetric, one scale per output channel. On an x86 CPU with AVX2 and a C compiler,
  ragkv's own kernel (:mod:`ragkv.model.native`: fp32 activations, at the memory's speed);
  elsewhere torch's (``torch._weight_int8pack_mm``, bf16 activations).
- ``int4``: asymmetric, one scale and offset per 32 input columns of a row
  (``torch._weight_int4pack_mm_for_cpu``); the LM head keeps int8 (its 150K rows are the
  logits themselves: 4 bits there cost the most quality per byte saved).
- ``fp16``: the weights rounded to fp16, packed for FBGEMM's fp16 GEMM, fp32 activations
  (``torch.ops.quantized.linear_dynamic_fp16``; x86 only). Twice int8's bytes, but its kernel
  streams them at the memory's speed where int8's is bound by its arithmetic (a CPU without
  native bf16 or VNNI); its rounding is far smaller than int8's (2^-11 of each weight, against
  half of 1/127 of its row's largest).

Which one is fastest depends on the CPU's instructions, not on the format's size alone:
:func:`time_formats` measures them on the model's own layers (``decode_weights="auto"`` picks
by it; ``ragkv.model.placement.resolve_decode_weights``).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ragkv.model import native

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZED", "available_formats", "quantize_int4", "quantize_int8", "quantized", "time_formats"]

Kernel = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] activations -> [rows, out]

INT4_GROUP = 32  # input columns sharing one int4 scale and offset (Q4_K's sub-block width)
# in_features the kernels handle (torch 2.13, CPU): int8 needs multiples of 16 (24 gave wrong sums,
# 13 a segfault); int4 needs whole groups
_ALIGN = {"int8": 16, "int4": INT4_GROUP, "fp16": 1}
_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()
_COPY_LOCK = threading.Lock()


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
    q, scales = quantize_int8(module.weight, torch.float32)
    slow_scales = scales.to(act)
    if not native.int8_available():
        return lambda x: torch._weight_int8pack_mm(x.to(act), q, slow_scales)

    fast = native.int8_kernel(q, scales)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= native.NATIVE_MAX_ROWS:  # a decode batch: the AVX2 kernel, fp32 activations
            return fast(x)
        return torch._weight_int8pack_mm(x.to(act), q, slow_scales)

    return kernel


def _int4_kernel(module: nn.Linear, act: torch.dtype) -> Kernel:
    q, sz = quantize_int4(module.weight)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, INT4_GROUP, sz)


FP16_BLOCK_ROWS = 16384  # output rows packed together: FBGEMM packs a 150K-row LM head 3x slower per row


def _fp16_kernel(module: nn.Linear, act: torch.dtype, block: int = FP16_BLOCK_ROWS) -> Kernel:
    weight = module.weight.detach().float()
    packs = [torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None) for w in weight.split(block)]
    if len(packs) == 1:
        return lambda x: torch.ops.quantized.linear_dynamic_fp16(x.float(), packs[0])
    return lambda x: torch.cat([torch.ops.quantized.linear_dynamic_fp16(x.float(), p) for p in packs], dim=-1)


_MAKERS: dict[str, Callable[[nn.Linear, torch.dtype], Kernel]] = {
    "int8": _int8_kernel,
    "int4": _int4_kernel,
    "fp16": _fp16_kernel,
}
QUANTIZED: tuple[str, ...] = tuple(_MAKERS)
_HEAD = {"int8": "int8", "int4": "int8", "fp16": "fp16"}  # the LM head's format for each
_BYTES = {"int8": 1.0, "int4": 0.5, "fp16": 2.0}  # bytes a weight takes in each


def available_formats() -> tuple[str, ...]:
    """The formats this torch build has kernels for (``fp16`` needs FBGEMM: x86)."""
    return tuple(f for f in QUANTIZED if f != "fp16" or "fbgemm" in torch.backends.quantized.supported_engines)


def time_formats(
    model: Any, formats: Sequence[str], layers: int = 4, repeats: int = 5, rows: Sequence[int] = (1, 4)
) -> dict[str, float]:
    """Milliseconds a decode step of 1 row plus one of 4 rows (``rows``) take through the MLP linear
    layers of the first ``layers`` decoder layers with each format's kernels (each the best of
    ``repeats``): what picks ``auto``'s decode weights, for a stream alone and for a server's batch.

    Several layers, so that their weights (tens of MB) stream from memory as a decode step's do
    rather than sit in the cache. The kernels are made for the measurement and dropped after it.
    """
    act = torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    linears = [m for layer in model.model.layers[:layers] for m in layer.mlp.modules() if isinstance(m, nn.Linear)]
    times: dict[str, float] = {}
    with torch.inference_mode():
        for fmt in formats:
            fit = [m for m in linears if m.in_features % _ALIGN[fmt] == 0]
            kernels = list(zip(_make_kernels([(m, fmt) for m in fit], act), [m.in_features for m in fit], strict=True))
            total = 0.0
            for n in rows:
                inputs = {k: torch.randn(n, k, dtype=model.dtype) for _, k in kernels}
                best = math.inf
                for _ in range(repeats + 1):  # the first run warms the kernels' packing and threads
                    began = time.perf_counter()
                    for kernel, k in kernels:
                        kernel(inputs[k])
                    best = min(best, time.perf_counter() - began)
                total += best
            times[fmt] = round(total * 1000, 3)
    return times


def _make_kernels(jobs: Sequence[tuple[nn.Linear, str]], act: torch.dtype) -> list[Kernel]:
    """A kernel per ``(module, format)``, made on every core: the packing runs in C++ without the GIL
    (fp16's of Qwen 0.5B takes seconds)."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        return list(pool.map(lambda job: _MAKERS[job[1]](job[0], act), jobs))


class QuantLinear(nn.Module):
    """A linear layer computed by a weight-only kernel (its own weight stays with the model's module)."""

    def __init__(self, kernel: Kernel, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self.kernel, self.bias, self.in_features = kernel, bias, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the kernels take 2-D activations
        out = self.kernel(flat)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def _swapped(module: nn.Module, swap: dict[nn.Module, nn.Module]) -> nn.Module:
    """``module`` with the descendants in ``swap`` replaced: shallow copies down the paths to them,
    every other submodule (and every parameter) shared with ``module``."""
    if module in swap:
        return swap[module]
    children = dict(module.named_children())
    new = {name: _swapped(child, swap) for name, child in children.items()}
    if all(new[name] is child for name, child in children.items()):
        return module
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._modules.update(new)
    return clone


def quantized(model: Any, weights: str) -> Any:
    """``model`` whose decoder linear layers and LM head read ``weights`` copies (made once per model and format).

    Everything else (embeddings, norms, rotary tables, config) is the model's own, shared. On the
    CPU the kernels are fast for bf16 activations and slow for fp32 ones, so an fp32 model's
    activations go through them in bf16.
    """
    if weights not in _MAKERS:
        raise ValueError(f"quantized decode weights are one of {QUANTIZED}, got {weights!r}")
    with _COPY_LOCK:
        made = _COPIES.setdefault(model, {})
        if weights not in made:  # checked once, when the copy is made (decode steps ask on every step)
            if weights not in available_formats():
                raise ValueError(f"{weights} decode weights need FBGEMM (an x86 CPU build of torch); use one of "
                                 f"{', '.join(available_formats())}")  # fmt: skip
            made[weights] = _quantized_copy(model, weights)
        return made[weights]


def _quantized_copy(model: Any, weights: str) -> Any:
    act = torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    jobs: list[tuple[nn.Linear, str]] = []
    for module in [*model.model.layers.modules(), model.lm_head]:
        if not isinstance(module, nn.Linear):
            continue
        fmt = _HEAD[weights] if module is model.lm_head else weights
        if module.in_features % _ALIGN[fmt]:
            logger.warning(
                "%s decode: a %s keeps its weights (in_features %d)", fmt, type(module).__name__, module.in_features
            )
            continue
        jobs.append((module, fmt))
    kernels = _make_kernels(jobs, act)
    swap: dict[nn.Module, nn.Module] = {
        module: QuantLinear(kernel, module.bias, module.in_features)
        for (module, _), kernel in zip(jobs, kernels, strict=True)
    }
    added = sum(m.weight.numel() * _BYTES[fmt] for m, fmt in jobs)
    logger.info("%s decode weights: %.0f MB added", weights, added / 1e6)
    return _swapped(model, swap)
