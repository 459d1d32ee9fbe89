"""What a fused pass's causal mask costs when it is made whole, as fusion made it before
``ragkv.model.masks.PositionMask``: bytes and time to build, per fusion, by context length.

A fusion's recompute makes one mask per set of active rows: the default method's 40% of the chunk
tokens through the first layers, 30% after the first check, 15% after the second, the question
riding along each time. Each mask is ``[rows, slots]`` in the model's dtype. On a CPU ragkv's kernel
computes from the positions and now makes no mask; on a GPU a mask above ``MASK_BLOCK_BYTES`` is
made a block of rows at a time (at most that many bytes alive). This script times the whole masks
the earlier code built on this machine's CPU, and prints the largest one's size.

    python experiments/mask_cost.py [--contexts 4096,16384,32768] [--dtype bfloat16] [--repeats 3]

With ``--model M`` it times whole fusions instead (the default method, the question riding along,
the last row's logits, as the answer path fuses) over random chunks of 512 tokens at each context,
with the whole masks made up front (the earlier code) and with today's, interleaved, medians:

    python experiments/mask_cost.py --model $(../shared/models/fetch-model.sh qwen2.5-0.5b) --contexts 8192,16384
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from ragkv.bench.gpu import whole_mask
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from ragkv.model.masks import MASK_BLOCK_BYTES, causal_mask_at

SHARES = (0.40, 0.30, 0.15)  # the default method's active rows: the focus share, then after each check
QUESTION = 32


def rows_at(context: int, share: float, generator: torch.Generator) -> torch.Tensor:
    """Sorted slots of ``share`` of the context's tokens, the question's slots after them."""
    chosen = torch.randperm(context, generator=generator)[: int(share * context)].sort().values
    return torch.cat([chosen, torch.arange(context, context + QUESTION)])


def measure(context: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(context)
    sets = [rows_at(context, s, g) for s in SHARES]
    slots = context + QUESTION
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for pos in sets:
            mask = causal_mask_at(pos, slots, dtype, torch.device("cpu"))
            del mask
        best = min(best, time.perf_counter() - start)
    largest = max(len(p) for p in sets) * (-(-slots // 16) * 16) * dtype.itemsize
    return {"context": context, "build_ms": best * 1e3, "largest_mib": largest / 2**20}


def fusions(model: str, context: int, dtype: str, repeats: int) -> dict[str, float]:
    """Median seconds of a fusion at ``context`` tokens with the whole masks made up front and without."""
    a = load_model(model, dtype=dtype)
    g = torch.Generator().manual_seed(context)
    vocab = min(a.spec.vocab_size, 30_000)
    prefix = a.prefill_kv(torch.randint(100, vocab, (16,), generator=g).tolist())
    chunk_ids = [torch.randint(100, vocab, (512,), generator=g).tolist() for _ in range(context // 512)]
    chunks = [a.prefill_kv(ids, past=[prefix]) for ids in chunk_ids]
    inp = FusionInput(prefix, chunks, chunk_ids, torch.randint(100, vocab, (QUESTION,), generator=g).tolist())
    times: dict[str, list[float]] = {"whole": [], "today": []}
    for _ in range(repeats):
        for way in times:
            patch = (
                mock.patch.object(ModelAdapter, "position_mask", whole_mask)
                if way == "whole"
                else mock.patch.object(ModelAdapter, "position_mask", ModelAdapter.position_mask)
            )
            with patch, torch.inference_mode():
                start = time.perf_counter()
                fuse(a, inp, FusionConfig(), prefill_suffix=True, logits="last")
                times[way].append(time.perf_counter() - start)
    return {way: statistics.median(t) for way, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="time whole fusions of this model (a .gguf file or a hub name)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.model:
        print(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
        print("| context tokens | fusion, whole masks up front ms | fusion today ms | today / before |")
        print("|--:|--:|--:|--:|")
        for context in (int(c) for c in args.contexts.split(",")):
            r = fusions(args.model, context, args.dtype, args.repeats)
            print(
                f"| {context:,} | {r['whole'] * 1e3:,.0f} | {r['today'] * 1e3:,.0f} | {r['today'] / r['whole']:.3f} |"
            )
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; best of {args.repeats}")
    print("| context tokens | whole masks per fusion: build ms | largest mask MiB | on a GPU now, at most MiB |")
    print("|--:|--:|--:|--:|")
    for context in (int(c) for c in args.contexts.split(",")):
        r = measure(context, dtype, args.repeats)
        alive = min(r["largest_mib"], MASK_BLOCK_BYTES / 2**20)
        print(f"| {context:,} | {r['build_ms']:,.0f} | {r['largest_mib']:,.0f} | {alive:,.0f} |")


if __name__ == "__main__":
    main()
