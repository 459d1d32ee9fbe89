"""The recompute's attention work, through SDPA with fusion's masks against ragkv's kernel from positions.

    python experiments/attention_work.py [--contexts 4096,16384,32768] [--scale 4]

One default fusion at Llama-3.1-8B's shape (widths divided by ``--scale``, as
``experiments/gpu_traffic.py`` builds it), run on the CPU through torch's attention with fusion's
masks, as on a GPU. Every recompute attention call over a ``PositionMask`` is recorded: its rows'
slots and how torch runs it (``ragkv.model.masks``: the whole mask, or blocks of rows each over the
slots up to its last row). For each, this counts the (query row, key slot) pairs per query head
that each way computes:

- SDPA with the mask: every slot its block covers, for every row of the block (a kernel with an
  arbitrary mask skips nothing);
- ragkv's kernel (``ragkv.gpu.attention``): each tile of ``--block-m`` rows walks the slots up to its
  last row's, in steps of ``--block-n``.

and the FLOPs at full width (``4 * heads * head_dim`` per pair: two products), against the
causal minimum (each row its own position + 1 slots). Exact for the code as it runs; the time
each takes on a GPU is the bench's ("device tier, SDPA attention ms" against "device tier,
attention kernel ms").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragkv.bench.gpu import LLAMA_3_1_8B, _fused, _prompt, build_model  # noqa: E402
from ragkv.fusion import FusionConfig  # noqa: E402
from ragkv.model import attention  # noqa: E402
from ragkv.model.attention import PLAIN  # noqa: E402
from ragkv.model.masks import PositionMask  # noqa: E402
from ragkv.model.placement import cpu_has_native_bf16  # noqa: E402
from ragkv.types import ChunkKV  # noqa: E402

_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def _pairs(mask: PositionMask, block_m: int, block_n: int) -> tuple[int, int, int]:
    """(SDPA with the mask, the kernel, the causal minimum): query-slot pairs per head of one call."""
    pos = mask.query_pos
    spans = mask.spans() if mask.blocked else [(0, mask.rows, mask.num_keys)]  # the whole mask: one block
    sdpa = sum((end - start) * cut for start, end, cut in spans)
    kernel = 0
    for start in range(0, mask.rows, block_m):
        hi = int(pos[start : start + block_m].max()) + 1
        kernel += block_m * (-(-hi // block_n) * block_n)
    return sdpa, kernel, int((pos + 1).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768", help="prompt tokens (chunks of 512)")
    ap.add_argument("--scale", type=int, default=4, help="divide the widths by this (1, 2 or 4)")
    ap.add_argument("--block-m", type=int, default=128, help="the kernel's rows per tile (its first GPU tiling)")
    ap.add_argument("--block-n", type=int, default=64, help="the kernel's slots per step")
    args = ap.parse_args()
    s = args.scale
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    shape = dict(LLAMA_3_1_8B, vocab_size=4096)
    for key in _WIDTHS:
        shape[key] = LLAMA_3_1_8B[key] // s
    a = build_model(shape, torch.device("cpu"), dtype)
    a.scattered = lambda query_pos: PLAIN  # type: ignore[method-assign]  # torch's attention and masks, as on a GPU
    spec = a.spec
    heads = LLAMA_3_1_8B["num_attention_heads"]
    calls: list[tuple[int, int, int]] = []
    blocked = attention._blocked_attention

    def recorded(
        base: str, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, *rest: Any
    ):
        calls.append(_pairs(mask, args.block_m, args.block_n))
        return blocked(base, module, query, key, value, mask, *rest)

    attention._blocked_attention = recorded  # type: ignore[assignment]
    g = torch.Generator().manual_seed(1)

    def chunk(n: int, start: int) -> ChunkKV:
        k = torch.randn(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, generator=g).to(dtype)
        return ChunkKV(k, torch.randn(k.shape, generator=g).to(dtype), torch.arange(start, start + n), a.fingerprint)

    print(
        f"Llama-3.1-8B's shape, the default fusion; query-slot pairs summed over the recompute's attention calls, "
        f"TFLOP at full width ({heads} heads, D {spec.head_dim}); the kernel's tiles {args.block_m} x {args.block_n}\n"
    )
    print("| prompt tokens | calls | SDPA with the mask TFLOP | kernel TFLOP | kernel / SDPA | causal minimum TFLOP |")
    print("|--:|--:|--:|--:|--:|--:|")
    for context in (int(c) for c in args.contexts.split(",")):
        p = _prompt(shape["vocab_size"], context, 512)
        prefix = chunk(len(p.prefix), 0)
        chunks = [chunk(len(c), len(p.prefix)) for c in p.chunks]
        calls.clear()
        with torch.inference_mode():
            _fused(a, prefix, chunks, p, FusionConfig())
        sdpa, kernel, least = (sum(c[i] for c in calls) for i in range(3))
        tflop = 4 * heads * spec.head_dim / 1e12
        tokens = len(p.prefix) + sum(len(c) for c in p.chunks) + len(p.question)
        print(
            f"| {tokens:,} | {len(calls)} | {sdpa * tflop:,.2f} | {kernel * tflop:,.2f} | {kernel / sdpa:.2f} "
            f"| {least * tflop:,.2f} |"
        )


if __name__ == "__main__":
    main()
