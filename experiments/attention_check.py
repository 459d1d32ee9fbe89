"""How tight ragkv's attention kernel's check is: the kernel's error and wrong kernels' errors, in rounding units.

    python experiments/attention_check.py

Runs ``ragkv.gpu.attention.position_attention`` in Triton's interpreter on the CPU (bf16 products
there on fp32 copies, rounded to bf16 by truncation: the interpreter's) and prints
``rounding_excess`` (1 = the check's bound: twice SDPA's own error plus one ulp, row by row):

- the kernel itself, worst over the unit tests' grid of dtypes, head layouts, row and slot counts
  and position orders (``tests/gpu/test_position_attention.py``);
- four wrong kernels the bound must fail (every row seeing one slot more, the last row missing its
  own slot, the walk stopping a tile early, the neighbouring key head read), at the tests' shape
  (4 query heads over 2, 24 rows over 90 slots) and at a Llama-3.1-8B-like one (32 over 8, 130
  over 400), sorted positions;

and, compiled for an H100/H200 (sm_90) here, the shared memory each GPU tiling asks for. The same
numbers on any machine (no timing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragkv.gpu import attention as gattn  # noqa: E402
from tests.gpu.test_position_attention import _compiled, _inputs  # noqa: E402


def main() -> None:
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv, d in ((4, 2, 64), (2, 2, 128), (8, 1, 64)):
            for rows, slots in ((1, 33), (17, 150), (40, 77)):
                for order in ("scattered", "sorted"):
                    q, k, v, pos = _inputs(dtype, hq, hkv, d, rows, slots, order=order)
                    worst = max(worst, gattn.rounding_excess(gattn.position_attention(q, k, v, pos), q, k, v, pos))
    print(f"the kernel, worst over the tests' 36 cases: {worst:.2f} of the bound\n")
    print("| wrong kernel | 4/2 heads, 24 rows over 90 slots | 32/8 heads, 130 rows over 400 slots |")
    print("|---|--:|--:|")
    rows_out: dict[str, list[float]] = {}
    for hq, hkv, d, rows, slots in ((4, 2, 64, 24, 90), (32, 8, 128, 130, 400)):
        q, k, v, pos = _inputs(torch.bfloat16, hq, hkv, d, rows, slots, order="sorted")
        cut = pos.clone()
        cut[-1] -= 1
        early = pos.clamp_max(int(pos.max()) // 16 * 16 - 1)  # the interpreter's tiles are 16 slots
        wrong = {
            "every row sees one slot more": gattn.position_attention(q, k, v, (pos + 1).clamp_max(slots - 1)),
            "the last row misses its own slot": gattn.position_attention(q, k, v, cut),
            "the walk stops a tile early": gattn.position_attention(q, k, v, early),
            "the neighbouring key head": gattn.position_attention(q, k.roll(1, dims=1), v.roll(1, dims=1), pos),
        }
        for name, got in wrong.items():
            rows_out.setdefault(name, []).append(gattn.rounding_excess(got, q, k, v, pos))
    for name, (small, large) in rows_out.items():
        print(f"| {name} | {small:.1f} | {large:.1f} |")
    print("\nshared memory a block asks for, compiled for sm_90 (KiB; an H100 gives a block up to 227):")
    for config in gattn._CUDA_CONFIGS:
        sizes = [_compiled(config, d, group=4).metadata.shared / 1024 for d in (64, 128)]  # type: ignore[attr-defined]
        print(f"  {config}: head dim 64 {sizes[0]:.0f}, head dim 128 {sizes[1]:.0f}")


if __name__ == "__main__":
    main()
