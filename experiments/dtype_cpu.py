"""fp32 against bf16 on this machine: full prefill and fused TTFT, and fusion fidelity in each dtype.

    python experiments/dtype_cpu.py [--tokens 1024] [--repeats 3]

The default model is loaded in both dtypes. On the first built-in fusion prompt (cut to about
``--tokens`` context tokens) each dtype times (best of ``--repeats``, the two dtypes interleaved so
machine load hits both alike) full prefill of the whole prompt and query_focus fusion at 15%
(caches precomputed, as at query time), and reports the KL of the fused first-token distribution
against full prefill *in the same dtype*, plus bf16 full prefill against fp32 full prefill.
"""

from __future__ import annotations

import argparse
import time

import torch

from ragkv.bench.fusion import builtin_prompts, fit_chunks
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from ragkv.model.placement import cpu_has_native_bf16


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@torch.inference_mode()
def _run(
    a: ModelAdapter, prefix: list[int], chunks: list[list[int]], suffix: list[int]
) -> tuple[float, float, torch.Tensor, float]:
    """(full prefill ms, fused TTFT ms, full last-position logits, KL fused vs full)."""
    t0 = time.perf_counter()
    full = a.forward(prefix + sum(chunks, []) + suffix, a.build_cache([]), 0, logits="last")[-1]
    full_ms = (time.perf_counter() - t0) * 1000
    pre = a.prefill_kv(prefix)
    inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in chunks], chunks, suffix)
    t0 = time.perf_counter()
    fused = fuse(a, inp, FusionConfig(method="query_focus", ratio=0.15), prefill_suffix=True)
    logits = (
        fused.suffix_logits if fused.suffix_logits is not None else a.forward(suffix, fused.cache, fused.num_tokens)
    )
    fused_ms = (time.perf_counter() - t0) * 1000
    return full_ms, fused_ms, full, _kl(full[None], logits[-1][None])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    adapters = {dt: load_model("smollm2-135m", device="cpu", dtype=dt) for dt in ("float32", "bfloat16")}
    a = adapters["float32"]
    prompt = builtin_prompts(a, n=1)[0]
    prefix, chunks, suffix = a.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    kept = fit_chunks(len(prefix), chunks, args.tokens)
    n = len(prefix) + sum(len(c) for c in kept)
    best: dict[str, list[float]] = {dt: [float("inf"), float("inf")] for dt in adapters}
    out: dict[str, tuple[torch.Tensor, float]] = {}
    for _ in range(args.repeats):
        for dt, ad in adapters.items():
            full_ms, fused_ms, full, kl = _run(ad, prefix, kept, suffix)
            best[dt] = [min(best[dt][0], full_ms), min(best[dt][1], fused_ms)]
            out[dt] = (full, kl)
    print(
        f"CPU native bf16: {cpu_has_native_bf16()}; threads {torch.get_num_threads()}; context {n} tokens "
        f"({len(kept)} chunks) + {len(suffix)} question tokens"
    )
    print(
        "| dtype | full prefill ms | fused TTFT ms (query_focus 15%) | fused / full | KL fused vs full (same dtype) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for dt in adapters:
        f, u = best[dt]
        print(f"| {dt} | {f:.0f} | {u:.0f} | {u / f:.3f} | {out[dt][1]:.4f} |")
    print(
        f"KL of bf16 full prefill against fp32 full prefill (first answer token): "
        f"{_kl(out['float32'][0][None], out['bfloat16'][0][None]):.4f}"
    )


if __name__ == "__main__":
    main()
