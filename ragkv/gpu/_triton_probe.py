"""The Triton kernel behind :func:`ragkv.gpu.kernels.scale_mask`; imported only where Triton is.

Kept apart so that ``ragkv.gpu.kernels`` imports without Triton; ``triton.jit`` is applied by the
caller (for a GPU, or for Triton's interpreter on a CPU: the tests).
"""

from __future__ import annotations

import triton.language as tl


def scale_mask(
    s_ptr,  # type: ignore[no-untyped-def]  # Triton reads the annotations below, not Python's
    m_ptr,
    o_ptr,
    cols,
    queries,
    s_row_stride,
    m_row_stride,
    o_row_stride,
    scale,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    """Attention scores ``[rows, cols]`` (bf16 or fp16 products) to fp32 ``x * scale + mask``, each
    step rounded to fp32 as torch's ``scores.float() * scale + mask`` rounds it (launched without
    FMA contraction). Row ``i`` adds the mask's row ``i % queries`` (the mask ``[queries, cols]`` is
    shared by every head; a head's rows are its queries in order). bf16 scores come as int16 bits,
    widened by a shift (exact, also in Triton's interpreter)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < cols
    at = s_ptr + row * s_row_stride + c
    if BF16:
        x = (tl.load(at, mask=m, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(at, mask=m, other=0).to(tl.float32)
    bias = tl.load(m_ptr + (row % queries) * m_row_stride + c, mask=m, other=0)
    tl.store(o_ptr + row * o_row_stride + c, x * scale + bias, mask=m)
