"""The Triton kernel behind :func:`ragkv.gpu.attention.position_attention`; imported only where Triton is.

Kept apart so that ``ragkv.gpu.attention`` imports without Triton; ``triton.jit`` is applied by the
caller (for a GPU, or for Triton's interpreter on a CPU: the tests).

No ``from __future__ import annotations`` here: Triton's interpreter finds the ``tl.constexpr``
parameters by their annotations' objects, and would take string annotations for runtime values.
"""

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

# Reductions through ``tl.reduce`` with the combine functions ``tl.max`` and ``tl.sum`` use (their
# inputs here are fp32 or int64, which those two pass on as they are): ``tl.max`` and ``tl.sum`` are
# jitted functions of their own, which Triton's interpreter calls only in a process started with
# ``TRITON_INTERPRET=1``, while ``tl.reduce`` with these is computed by it directly (the tests).


@triton.constexpr_function
def _host_int(x):  # type: ignore[no-untyped-def]
    """A scalar of Triton's interpreter as a Python int (its tensors hold numpy arrays). A constexpr
    function only so that a compile accepts the reference; it is called in the interpreter alone."""
    return int(x.handle.data.reshape(-1)[0])


def position_attention(
    q_ptr,  # type: ignore[no-untyped-def]  # Triton reads the annotations below, not Python's
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    rows,
    q_head_stride,
    q_row_stride,
    k_head_stride,
    k_row_stride,
    v_head_stride,
    v_row_stride,
    o_row_stride,
    scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Flash attention of queries at scattered slots: query row ``i`` sees the key slots up to
    ``pos[i]`` (fusion's exact causal mask, computed from the positions: no mask tensor). One
    program takes ``BLOCK_M`` rows of one query head, reading its key and value head (``head //
    GROUP``), and walks the key slots only up to its rows' last position, so the work follows each
    tile's positions (a masked call over every slot does the work of the whole mask).

    Online softmax in fp32 (exponentials base 2: ``scale`` is the softmax scale times log2(e)), the
    products on tensor cores with fp32 accumulation, the probabilities rounded to the values' dtype
    for the second product: what flash kernels do, so the output is within rounding of SDPA's.
    Positions are in ``[0, slots)`` (checked by the caller), so every row sees slot 0: the running
    maximum is finite after the first tile and no row divides by zero. Rows past ``rows`` read
    position 0 and are not stored. ``WIDEN`` (the interpreter with bf16,
    whose products it computes wrong) runs the products on fp32 copies of the same bf16 values.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m64 = m.to(tl.int64)  # row offsets past 2**31 elements at long contexts
    d = tl.arange(0, D)
    live = m < rows
    pos = tl.load(pos_ptr + m, mask=live, other=0)
    q = tl.load(q_ptr + head * q_head_stride + m64[:, None] * q_row_stride + d[None, :], mask=live[:, None], other=0.0)
    k_base = k_ptr + kv_head * k_head_stride
    v_base = v_ptr + kv_head * v_head_stride
    hi = tl.reduce(pos, None, _elementwise_max) + 1  # slots from here on are seen by none of the tile's rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
    # Triton's interpreter takes no tensor as a loop bound (with numpy 2): there the bound is read as a
    # Python int (the branch is never compiled: INTERPRET is a constexpr)
    for start in range(0, _host_int(hi) if INTERPRET else hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        seen = n < hi
        k = tl.load(k_base + n[None, :].to(tl.int64) * k_row_stride + d[:, None], mask=seen[None, :], other=0.0)
        s = (tl.dot(q.to(tl.float32), k.to(tl.float32)) if WIDEN else tl.dot(q, k)) * scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _elementwise_max))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v = tl.load(v_base + n[:, None].to(tl.int64) * v_row_stride + d[None, :], mask=seen[:, None], other=0.0)
        if WIDEN:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + m64[:, None] * o_row_stride + head * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=live[:, None]
    )
