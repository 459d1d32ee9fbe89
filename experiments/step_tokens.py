"""What a prefill piece costs: the server's ``--step-tokens`` against one decode step.

    python experiments/step_tokens.py [--model smollm2-135m] [--tokens 1600] [--repeats 3]
        [--dtype auto] [--threads 0] [--budgets 64,128,256,512]

On the first built-in fusion prompt (cut to about ``--tokens`` context tokens), in the dtype the
server would choose, it times (best of ``--repeats``): a batched decode step of 1 and 4 rows at that
context; the full prefill whole and in pieces of 64..512 tokens (total, and the longest piece: what
a running stream waits for on top of its own step); and the fused prefill (query_focus 15%, caches
precomputed) in pieces of the same budgets. A piece budget near one decode step's time keeps the
streams' inter-token gap within ~2x a step; smaller pieces cost more in total (each re-reads the
weights).
"""

from __future__ import annotations

import argparse
import time

import torch

from ragkv.bench.fusion import builtin_prompts, fit_chunks
from ragkv.fusion import FusionConfig, FusionInput, fuse_steps
from ragkv.model import ModelAdapter, load_model
from ragkv.model.batch import DecodeBatch

BUDGETS = (64, 128, 256, 512)


def _timed(pieces) -> tuple[float, float, int]:
    """(total ms, longest piece ms, pieces) of draining ``pieces``."""
    longest, n, t_all = 0.0, 0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            next(pieces)
        except StopIteration:
            longest = max(longest, time.perf_counter() - t0)
            return (time.perf_counter() - t_all) * 1000, longest * 1000, n + 1
        longest, n = max(longest, time.perf_counter() - t0), n + 1


def _full(a: ModelAdapter, ids: list[int], step: int | None):
    cache = a.build_cache([])
    size = step or len(ids)
    starts = list(range(0, len(ids), size))
    for s in starts[:-1]:
        a.forward(ids[s : s + size], cache, s, logits="none")
        yield
    a.forward(ids[starts[-1] :], cache, starts[-1], logits="last")


@torch.inference_mode()
def _decode_ms(a: ModelAdapter, ids: list[int], rows: int, steps: int = 8) -> float:
    batch = DecodeBatch(a)
    cache = a.build_cache([])
    a.forward(ids, cache, 0, logits="none")
    for r in range(rows):
        batch.add(str(r), cache, len(ids), reserve=steps + 1)
    batch.step([1] * rows)  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step([1] * rows)
    return (time.perf_counter() - t0) * 1000 / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own count)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="piece budgets, comma-separated")
    args = ap.parse_args()
    a = load_model(args.model, device="cpu", dtype=args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = builtin_prompts(a, n=1)[0]
    prefix, chunks, suffix = a.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    kept = fit_chunks(len(prefix), chunks, args.tokens)
    ids = prefix + sum(kept, []) + suffix
    with torch.inference_mode():
        pre = a.prefill_kv(prefix)
        inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in kept], kept, suffix)
    fusion = FusionConfig(method="query_focus", ratio=0.15)
    print(f"{a.name} in {a.dtype}, {torch.get_num_threads()} threads; prompt {len(ids)} tokens")
    for rows in (1, 4):
        print(f"decode step, {rows} row(s): {min(_decode_ms(a, ids, rows) for _ in range(args.repeats)):.1f} ms")
    print("| pass | piece budget | pieces | total ms | longest piece ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for budget in (None, *(int(b) for b in args.budgets.split(","))):
        with torch.inference_mode():
            full = min((_timed(_full(a, ids, budget)) for _ in range(args.repeats)), key=lambda r: r[0])
            steps = (fuse_steps(a, inp, fusion, prefill_suffix=True, step_tokens=budget) for _ in range(args.repeats))
            fused = min((_timed(s) for s in steps), key=lambda r: r[0])
        for name, (total, longest, pieces) in (("full", full), ("fused", fused)):
            print(f"| {name} | {budget or 'whole'} | {pieces} | {total:,.0f} | {longest:,.0f} |")


if __name__ == "__main__":
    main()
