"""One chunk's prefill with 2 threads against 1, alternated, beside other work (the thread policy's case).

    python experiments/threads_prefill.py [--model smollm2-135m] [--tokens 512] [--busy 1] [--rounds 2]

``--busy N`` starts N processes spinning on a core each (``ragkv.bench.peer.busy_processes``) for
the run; without it, whatever else the machine runs is the other work. Prints the seconds of each
``prefill_kv`` with the thread count set by hand (``RAGKV_THREADS`` plays no part here).
"""

from __future__ import annotations

import argparse
import time

import torch

from ragkv.bench.peer import busy_processes
from ragkv.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    a = load_model(args.model)
    ids = list(range(1000, 1000 + args.tokens))
    with busy_processes(args.busy):
        for _ in range(args.rounds):
            for threads in (2, 1):
                torch.set_num_threads(threads)
                a.prefill_kv(ids[:64])  # the new thread count's first region, untimed
                started = time.perf_counter()
                a.prefill_kv(ids)
                print(f"{threads} threads: {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
