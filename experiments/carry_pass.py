"""One carried pass against its two parts: a prefill piece alone, a decode step alone, the piece carrying the step.

    python experiments/carry_pass.py --model M [--dtype bfloat16] [--threads 1] [--piece 253] [--rows 3]
    python experiments/carry_pass.py --model M --sweep 240,248,256,257,264   # a forward's cost by token count

The piece runs ``--piece`` prompt tokens on top of an 8-token cache; the rows decode at about
1,500-1,540 context tokens. Medians of 3 after one warm-up. ``--sweep`` times a plain forward of
each token count instead (how a matmul's row count past a multiple of its blocking costs more).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragkv.model import load_model
from ragkv.model.batch import DecodeBatch

IDS = [1000 + (i * 7919) % 30000 for i in range(1600)]


def _median_ms(fn, repeats: int = 4) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1000


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--piece", type=int, default=253)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--sweep", default="")
    args = ap.parse_args()
    a = load_model(args.model, device="cpu", dtype=args.dtype)
    torch.set_num_threads(args.threads)

    def head():
        cache = a.build_cache([])
        a.forward(IDS[:8], cache, 0, logits="none")
        return cache

    if args.sweep:
        for n in (int(x) for x in args.sweep.split(",")):
            caches = iter([head() for _ in range(4)])
            ms = _median_ms(lambda n=n, caches=caches: a.forward(IDS[8 : 8 + n], next(caches), 8, logits="none"))
            print(f"{a.dtype} forward of {n} tokens: {ms:.0f} ms ({1000 * ms / n:.0f} us a token)")
        return
    base = a.build_cache([])
    a.forward(IDS, base, 0, logits="none")

    def batch() -> DecodeBatch:
        b = DecodeBatch(a)
        for r in range(args.rows):
            b.add(str(r), base, 1500 + 20 * r, reserve=64)
        return b

    tokens = list(range(5, 5 + args.rows))
    piece = IDS[8 : 8 + args.piece]
    caches = iter([head() for _ in range(4)])
    alone = _median_ms(lambda: a.forward(piece, next(caches), 8, logits="none"))
    batches = iter([batch() for _ in range(4)])
    step = _median_ms(lambda: next(batches).step(tokens))
    pairs = iter([(batch(), head()) for _ in range(4)])

    def carried() -> None:
        b, cache = next(pairs)
        b.carried_step(tokens, torch.tensor(piece), cache, 8, "none")

    both = _median_ms(carried)
    print(
        f"{a.dtype}, {args.threads} thread(s): {args.piece}-token piece {alone:.0f} ms, "
        f"{args.rows}-row step {step:.0f} ms, the piece carrying the step {both:.0f} ms "
        f"(saves {alone + step - both:.0f} ms)"
    )


if __name__ == "__main__":
    main()
