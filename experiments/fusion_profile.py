"""Where a fused prefill's time goes on a CPU: full prefill against the default fusion on one QA prompt,
the fusion's token-layer passes, a cProfile of one fusion, and the model's largest matrix product at
the batch sizes fusion runs (the question probe's, the recompute's, full prefill's).

    python experiments/fusion_profile.py --model ~/.cache/ragkv-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

Run it on a quiet machine: the timings are the point. docs/benchmarks.md ("Qwen2.5 1.5B on both sets")
quotes one run on the own set's first question.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from ragkv.bench.qa_data import build_prompt, load_qa_set
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--question", type=int, default=0, help="index into the QA set (own set)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    a = load_model(args.model, device="cpu", dtype="auto")
    qa = load_qa_set(None)
    p = build_prompt(qa, qa.questions[args.question], lambda t: len(a.encode(t)))
    prefix, chunks, suffix = a.chat_segments(p.get("system"), p["chunks"], p["question"])
    ctx = prefix + [t for c in chunks for t in c]
    print(f"{len(ctx) + len(suffix)} tokens, chunks {[len(c) for c in chunks]}, question {len(suffix)}, "
          f"{torch.get_num_threads()} threads, {a.dtype}")  # fmt: skip
    pre = a.prefill_kv(prefix)
    cached = [a.prefill_kv(c, past=[pre]) for c in chunks]

    def full() -> object:
        return a.forward(ctx + suffix, a.build_cache([]), 0, logits="last")  # as an engine: the last logits only

    def fused() -> object:
        return fuse(a, FusionInput(pre, cached, chunks, suffix), FusionConfig(), prefill_suffix=True)

    with torch.inference_mode():
        fused()  # warm-up
        times: dict[str, list[float]] = {"full": [], "fused": []}
        for _ in range(args.rounds):
            for name, f in (("full", full), ("fused", fused)):
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        print({k: [round(x, 2) for x in v] for k, v in times.items()},
              f"fused / full {min(times['fused']) / min(times['full']):.3f}")  # fmt: skip
        profile = cProfile.Profile()
        profile.enable()
        ctx_out = fused()
        profile.disable()
        passes = ctx_out.token_passes  # type: ignore[attr-defined]
        layers = a.spec.num_layers
        print(f"token-layer passes: fused {passes:,}, full {(len(ctx) + len(suffix)) * layers:,}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(8)
        # the largest matrix product (an MLP up projection) at the batch sizes fusion runs
        decoder = (m for n, m in a.model.named_modules() if "layers." in n and isinstance(m, torch.nn.Linear))
        mlp = max(decoder, key=lambda m: m.weight.numel())
        w = mlp.weight
        for rows in (len(suffix), 232, 574, len(ctx) + len(suffix)):
            x = torch.randn(rows, w.shape[1], dtype=w.dtype)
            torch.nn.functional.linear(x, w)
            t = time.perf_counter()
            for _ in range(5):
                torch.nn.functional.linear(x, w)
            dt = (time.perf_counter() - t) / 5
            print(f"{tuple(w.shape)} x {rows} rows: {dt * 1e3:.1f} ms, {2 * rows * w.numel() / dt / 1e9:.0f} GFLOPS")


if __name__ == "__main__":
    main()
