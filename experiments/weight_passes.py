"""What one pass over the weights costs on this machine: the floor under every fusion method.

    python experiments/weight_passes.py

Times (best of 3) on the second built-in fusion prompt: the full prompt's prefill, its question
(suffix) prefilled on top of the cached context, and a single token on top of it. A pass for a
few dozen tokens costs a large fraction of one for a single token: memory bound on the weights.
"""

from __future__ import annotations

import time

import torch

from ragkv.bench.fusion import builtin_prompts
from ragkv.model import load_model


@torch.inference_mode()
def main() -> None:
    adapter = load_model("smollm2-135m")
    prompt = builtin_prompts(adapter, n=2)[1]
    prefix, chunks, suffix = adapter.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    context = prefix + [t for c in chunks for t in c]
    kv = adapter.prefill_kv(context)

    def best(ids: list[int], past: list) -> float:
        times = []
        for _ in range(3):
            cache = adapter.build_cache(past)
            t0 = time.perf_counter()
            int(adapter.forward(ids, cache, len(context) if past else 0, logits="last")[-1].argmax())
            times.append((time.perf_counter() - t0) * 1000)
        return min(times)

    params = sum(p.numel() * p.element_size() for p in adapter.model.parameters()) / 1e6
    print(f"weights: {params:.0f} MB ({adapter.dtype}), {torch.get_num_threads()} torch threads")
    print(f"full prefill, {len(context) + len(suffix)} tokens: {best(context + suffix, []):.0f} ms")
    print(f"question, {len(suffix)} tokens on the cached context: {best(suffix, [kv]):.0f} ms")
    print(f"one token on the cached context: {best(suffix[:1], [kv]):.0f} ms")


if __name__ == "__main__":
    main()
