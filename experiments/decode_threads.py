"""A request's chunks decoded one after another against side by side on the loader's decode threads.

    python experiments/decode_threads.py [--workers 1,2] [--repeats 5]

Synthetic chunks (Gaussian K/V, 512 tokens each), encoded once, then decoded as the loader decodes
a request's hits (``ragkv.retriever.decoding.decode_all``, checks included) with each worker count:

- ``llama8b raw view``: 16 chunks of Llama-3.1-8B's shape (32 layers, 8 KV heads, 128 dims; 1.07
  GB) kept on the host as fp16 views, as the loader does for a model on a GPU: the decode is the
  checksum (a 16K-token prompt holds 31 such chunks);
- ``llama8b raw bf16``: the same converted to bf16, as for a CPU model in bf16;
- ``qwen0.5b cachegen:0 bf16``: 10 chunks of Qwen2.5-0.5B's shape (24 layers, 2 KV heads, 64 dims),
  the default codec, to bf16: the default model path on a CPU.

Prints the best of ``--repeats`` per worker count and the speed-up over one worker. The figures
are the machine's own: run it on the machine whose default (``DEFAULT_WORKERS``: half the cores,
1 to 8) is in question.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from ragkv import codec
from ragkv.retriever.decoding import DEFAULT_WORKERS, decode_all
from ragkv.types import ChunkKV, CodecSpec, StorageKey

_KEY = StorageKey("0123456789abcdef/decode-threads")

CASES = {
    # name: (shape [layers, kv heads, tokens, head dim], chunks, codec, decoded dtype, view)
    "llama8b raw view": ((32, 8, 512, 128), 16, CodecSpec("raw", 0), torch.float16, True),
    "llama8b raw bf16": ((32, 8, 512, 128), 16, CodecSpec("raw", 0), torch.bfloat16, False),
    "qwen0.5b cachegen:0 bf16": ((24, 2, 512, 64), 10, CodecSpec("cachegen", 0), torch.bfloat16, False),
}


def _blobs(shape: tuple[int, int, int, int], count: int, spec: CodecSpec) -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        out.append(codec.encode(ChunkKV(keys, values, torch.arange(shape[2]), "m"), spec, key=_KEY).data)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2", help="worker counts to compare (the first is the baseline)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per count (best kept)")
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, DEFAULT_WORKERS {DEFAULT_WORKERS}")
    print("| case | MB stored | " + " | ".join(f"{w} workers ms" for w in counts) + " | speed-up |")
    print("|---|--:|" + "--:|" * len(counts) + "--:|")
    for name, (shape, count, spec, dtype, view) in CASES.items():
        blobs = _blobs(shape, count, spec)
        calls = [functools.partial(codec.decode, b, expect=None, dtype=dtype, view=view) for b in blobs]
        best = {w: float("inf") for w in counts}
        for _ in range(args.repeats + 1):  # interleaved, so that a noisy neighbour hits every count
            for w in counts:
                started = time.perf_counter()
                decode_all(calls, workers=w)
                best[w] = min(best[w], time.perf_counter() - started)
        mb = sum(map(len, blobs)) / 1e6
        cells = " | ".join(f"{best[w] * 1e3:.1f}" for w in counts)
        print(f"| {name} | {mb:,.0f} | {cells} | {best[counts[0]] / best[counts[-1]]:.2f}x |")


if __name__ == "__main__":
    main()
