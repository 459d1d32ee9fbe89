"""Placement's key turn on a CPU: from an fp32 copy of the keys (what the CPU does) against the keys
as stored (what CUDA does, ``ragkv.gpu.feed._turns_as_stored``).

    python experiments/turn_keys_cpu.py [--heads 8] [--tokens 3000] [--rounds 21]

A bf16 slice ``[1, heads, tokens, 128]`` of a larger buffer is turned by Llama's rotation with fp32
tables and copied back, the two ways interleaved; medians in ms. The numbers are the same either
way (``tests/gpu/test_feed.py``); on a CPU torch converts a mixed-dtype product's half input into
an fp32 temporary first (twice: the keys and their rotated half), which the one copy beats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragkv.model.rotary import turn_keys  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, args.heads, args.tokens + 200, 128, generator=g).bfloat16()
    k = buf[1:2, :, 100 : 100 + args.tokens]
    cos, sin = torch.randn(1, args.tokens, 128, generator=g), torch.randn(1, args.tokens, 128, generator=g)

    def fn(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return apply_rotary_pos_emb(x[:0], x, c, s)[1]

    ways = {
        "from an fp32 copy": lambda: k.copy_(turn_keys(k.float(), cos, sin, fn)),
        "as stored": lambda: k.copy_(turn_keys(k, cos, sin, fn)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - t0) * 1e3)
    shape = f"[1, {args.heads}, {args.tokens}, 128] bf16, {torch.get_num_threads()} threads"
    print(shape + ": " + "; ".join(f"{n} {statistics.median(t):.2f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
