"""The Triton kernel behind :func:`ragkv.gpu.kernels.turn_keys_`; imported only where Triton is.

Kept apart so that ``ragkv.gpu.kernels`` imports without Triton. Triton compiles a kernel from its
source, so the function is plain Python here and ``triton.jit`` is applied by the caller (for a GPU,
or for Triton's interpreter on a CPU: the tests).
"""

from __future__ import annotations

import triton.language as tl


def turn_half_split(
    k_ptr,  # type: ignore[no-untyped-def]  # Triton reads the annotations below, not Python's
    cos_ptr,
    sin_ptr,
    rows,
    head_stride,
    row_stride,
    table_stride,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Keys ``[heads, rows, 2 * HALF]`` (strided heads and rows) turned in place by fp32 tables
    ``[rows, 2 * HALF]``: ``x * cos + rotate_half(x) * sin`` in fp32, each product and the sum rounded
    to fp32 (launched without FMA contraction), the result rounded to the keys' dtype to nearest even.

    ``rotate_half(x)`` is ``(-x2, x1)``; torch adds ``x1 * c1`` and ``(-x2) * s1``, which IEEE makes
    the same as subtracting ``x2 * s1`` (signed zeros included); Triton would compute ``-x2`` as
    ``0 - x2``, which turns -0 into +0. bf16 keys come as int16 bits, widened to fp32 by a shift
    (exact). On a GPU the result is rounded with the hardware's conversion, as torch's CUDA kernels
    round (``__float2bfloat16``); in Triton's interpreter (``INTERPRET``: a CPU's tensors, the tests)
    with torch's CPU rule (``c10::BFloat16``), since the interpreter's own conversion truncates.
    """
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HALF)
    m = (r < rows)[:, None]
    at = k_ptr + h * head_stride + r[:, None].to(tl.int64) * row_stride + d[None, :]
    tab = r[:, None] * table_stride + d[None, :]
    if BF16:
        x1 = (tl.load(at, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        x2 = (tl.load(at + HALF, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x1 = tl.load(at, mask=m, other=0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=m, other=0).to(tl.float32)
    c1 = tl.load(cos_ptr + tab, mask=m, other=0)
    c2 = tl.load(cos_ptr + tab + HALF, mask=m, other=0)
    s1 = tl.load(sin_ptr + tab, mask=m, other=0)
    s2 = tl.load(sin_ptr + tab + HALF, mask=m, other=0)
    # rotate_half(x) = (-x2, x1): the same products and sum as the model's rotation in fp32
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    if BF16 and not INTERPRET:
        tl.store(at, o1.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=m)
        tl.store(at + HALF, o2.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=m)
    elif BF16:
        b1 = o1.to(tl.uint32, bitcast=True)
        b2 = o2.to(tl.uint32, bitcast=True)
        b1 = tl.where(o1 != o1, 0x7FC00000, b1 + 0x7FFF + ((b1 >> 16) & 1))  # NaN: a quiet NaN, as in torch
        b2 = tl.where(o2 != o2, 0x7FC00000, b2 + 0x7FFF + ((b2 >> 16) & 1))
        tl.store(at, (b1 >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=m)
        tl.store(at + HALF, (b2 >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=m)
    else:
        tl.store(at, o1.to(k_ptr.dtype.element_ty), mask=m)
        tl.store(at + HALF, o2.to(k_ptr.dtype.element_ty), mask=m)
