"""A pass run for its cache (indexing a chunk) with its last layer cut to the K/V it writes, against whole.

    python experiments/cache_pass_cut.py --model M [--dtype bfloat16] [--tokens 512] [--repeats 7]

``ModelAdapter.prefill_kv`` of a chunk of ``--tokens`` random tokens after a 30-token prefix, as
indexing runs it, timed with ``ragkv.model.lean.kv_only_last_layer`` (the default) and with the
last layer run whole (transformers' stack as it is), interleaved, medians. The caches are equal bit
for bit (``tests/model/test_lean.py``); this measures only the time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragkv.model import adapter as adapter_mod
from ragkv.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the model's auto)")
    ap.add_argument("--tokens", type=int, default=512, help="chunk length")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    a = load_model(args.model, dtype=args.dtype)
    ids = torch.randint(100, 20000, (args.tokens + 30,), generator=torch.Generator().manual_seed(0)).tolist()
    prefix = a.prefill_kv(ids[:30])
    cut = adapter_mod.kv_only_last_layer

    def whole(model: object, run, cache: object) -> bool:  # type: ignore[no-untyped-def]
        run()
        return False

    times: dict[str, list[float]] = {"cut": [], "whole": []}
    try:
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, fn in (("cut", cut), ("whole", whole)):
                    adapter_mod.kv_only_last_layer = fn  # type: ignore[assignment]
                    started = time.perf_counter()
                    a.prefill_kv(ids[30:], past=[prefix])
                    times[name].append(time.perf_counter() - started)
    finally:
        adapter_mod.kv_only_last_layer = cut
    c, w = statistics.median(times["cut"]), statistics.median(times["whole"])
    print(f"{args.model} ({a.dtype}, {a.spec.num_layers} layers): prefill_kv of {args.tokens} tokens after 30")
    print(f"last layer cut {c * 1e3:.0f} ms, whole {w * 1e3:.0f} ms: {c / w:.3f} of the time")


if __name__ == "__main__":
    main()
