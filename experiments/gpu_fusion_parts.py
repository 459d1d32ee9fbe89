"""Where fusion's time goes, step by step, on the GPU path of experiments/gpu_llama8b.py.

    python experiments/gpu_fusion_parts.py                  # Llama-3.1-8B shape on CUDA: 4K and 16K tokens
    python experiments/gpu_fusion_parts.py --profile        # also torch.profiler's kernels (16K: naive, query_focus)
    python experiments/gpu_fusion_parts.py --tiny           # a CPU smoke run on a tiny config

The same random-weight model and prompts as gpu_llama8b.py (chunks of 512 tokens, already on the
device: the "fuse only" column). Each of fusion's internal steps (``ragkv.fusion._place``,
``_question_attention``, ``_recompute``, ``_checked_layer``, ``_finish``) and a few adapter calls
are wrapped with a synchronized wall clock; nested steps overlap (``_checked_layer`` is inside
``_recompute``). Prints one line per method: its total and each step's milliseconds per call.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_llama8b as g  # noqa: E402

import ragkv.fusion as F  # noqa: E402
from ragkv.fusion import FusionConfig  # noqa: E402
from ragkv.model.adapter import ModelAdapter  # noqa: E402

STEPS = ("_place", "_question_attention", "_recompute", "_finish", "_checked_layer", "_reused")
ADAPTER = ("rerotate", "causal_mask", "position_embeddings", "final_logits", "embed", "dynamic_cache", "scatter_cache")


def _timers(device: torch.device) -> tuple[dict[str, float], collections.Counter[str]]:
    """Wrap fusion's steps and the adapter calls with synced timers; return (seconds, calls) per name."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()

    def wrap(owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            g._sync(device)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                g._sync(device)
                seconds[name] += time.perf_counter() - t
                calls[name] += 1

        def timed_pieces(*args: Any, **kwargs: Any) -> Any:  # a pass run in pieces (fusion's generators)
            g._sync(device)
            t = time.perf_counter()
            try:
                return (yield from fn(*args, **kwargs))
            finally:
                g._sync(device)
                seconds[name] += time.perf_counter() - t
                calls[name] += 1

        wrapper = timed_pieces if inspect.isgeneratorfunction(fn) else timed
        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    for name in STEPS:
        wrap(F, name)
    for name in ADAPTER:
        wrap(ModelAdapter, name)
    return seconds, calls


def _profile(fused: Callable[[], Any], device: torch.device) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fused()
        g._sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("needs a CUDA device; pass --tiny for a CPU smoke run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = g.build_model(g.TINY if args.tiny else g.LLAMA_3_1_8B, device, dtype)
    chunk = 64 if args.tiny else 512
    contexts = (1024,) if args.tiny else (4096, 16384)
    seconds, calls = _timers(device)  # full prefill calls none of the wrapped functions
    for context in contexts:
        p = g._prompt(a.spec.vocab_size, context, chunk)
        prefix = a.prefill_kv(p.prefix)
        chunks = [a.prefill_kv(c, past=[prefix]) for c in p.chunks]
        full_s, _, _ = g._timed(partial(g._full_prefill, a, p), device, 2)
        print(f"== {context} tokens: full prefill {full_s * 1e3:.1f} ms", flush=True)
        for method in ("naive", "query_focus", "blend"):
            cfg = FusionConfig(method=method, ratio=0.15)
            g._fused(a, prefix, chunks, p, cfg)  # warm-up, untimed
            seconds.clear()
            calls.clear()
            g._sync(device)
            t = time.perf_counter()
            for _ in range(2):
                g._fused(a, prefix, chunks, p, cfg)
            g._sync(device)
            total = (time.perf_counter() - t) / 2
            parts = ", ".join(
                f"{k} {v / 2 * 1e3:.1f} ms/{calls[k] // 2}" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
            )
            print(f"{method}: {total * 1e3:.1f} ms ({parts})", flush=True)
            if args.profile and context == contexts[-1] and method != "blend":
                _profile(partial(g._fused, a, prefix, chunks, p, cfg), device)


if __name__ == "__main__":
    main()
