"""What a fusion's question probe costs on a CPU, and whether a cheaper probe would rank the same tokens.

    python experiments/probe_cost.py --model ~/.cache/ragkv-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Three parts, on the own QA set's prompts:

1. ``phases``: per prompt (``--phases``, indices into the set), full prefill (last logits only, as an
   engine), the default fusion (last logits only, as the answer path), naive reuse, placement and the
   question probe, each the best of three (``--repeats``).
2. ``depth``: a probe stopped after layer P instead of the last (``--depth-prompts`` prompts, every
   third of the set): the share of the tokens the whole probe ranks first (the top 40% after the
   first check, the top 15% after the second, as the default's initial set and final cut use
   them) that the shorter probe ranks first too.
3. ``products``: one of the model's largest decoder matrices at the probe's row counts, in the
   model's dtype and through the int8 decode copy's kernels (ragkv's below 17 rows, torch's above),
   over 12 copies of the matrix so that it streams from memory as a pass's weights do.

Run it on a quiet machine: parts 1 and 3 are timings. docs/benchmarks.md ("Today: rows that write
their K/V alone") quotes one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ragkv.bench.qa_data import QASet, build_prompt, load_qa_set
from ragkv.fusion import FusionConfig, FusionInput, _place, _question_attention, fuse
from ragkv.model import ModelAdapter, load_model, native
from ragkv.model.quant import quantize_int8


def _best(f: Callable[[], object], repeats: int) -> float:
    """Milliseconds of the fastest of ``repeats`` calls (after one untimed)."""
    f()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        f()
        times.append(time.perf_counter() - began)
    return min(times) * 1000


def _input(a: ModelAdapter, qa: QASet, index: int) -> tuple[list[int], FusionInput]:
    p = build_prompt(qa, qa.questions[index], lambda t: len(a.encode(t)))
    prefix, chunks, suffix = a.chat_segments(p.get("system"), p["chunks"], p["question"])
    pre = a.prefill_kv(prefix)
    cached = [a.prefill_kv(c, past=[pre]) for c in chunks]
    return prefix + [t for c in chunks for t in c], FusionInput(pre, cached, chunks, suffix)


def _probe(a: ModelAdapter, inp: FusionInput) -> torch.Tensor:
    """The question's attention ``[layers, chunk tokens]``, as fusion's probe computes it."""
    placed = _place(a, inp, len(inp.suffix_ids))
    suffix = torch.tensor(list(inp.suffix_ids))
    return _question_attention(a, placed.keys, placed.values, suffix, placed.n_ctx, placed.slots, placed.feed)


def phases(a: ModelAdapter, qa: QASet, indices: list[int], repeats: int) -> None:
    for i in indices:
        print(_phase(a, qa, i, repeats))


def _phase(a: ModelAdapter, qa: QASet, index: int, repeats: int) -> str:
    """One prompt's line of :func:`phases`."""
    ctx, inp = _input(a, qa, index)
    suffix = list(inp.suffix_ids)
    full = _best(lambda: a.forward(ctx + suffix, a.build_cache([]), 0, logits="last"), repeats)
    fused = _best(lambda: fuse(a, inp, FusionConfig(), prefill_suffix=True, logits="last"), repeats)
    naive_cfg = FusionConfig(method="naive", ratio=0.0)
    naive = _best(lambda: fuse(a, inp, naive_cfg, prefill_suffix=True, logits="last"), repeats)
    place = _best(lambda: _place(a, inp, len(suffix)), repeats)
    probe = _best(lambda: _probe(a, inp), repeats) - place
    return (
        f"{qa.questions[index].id}: {len(ctx) + len(suffix)} tokens, question {len(suffix)}: full {full:.0f} ms, "
        f"default {fused:.0f} ({fused / full:.3f} of full), naive {naive:.0f}, placement {place:.0f}, "
        f"probe {probe:.0f} ({probe / full:.3f} of full)"
    )


def depth(a: ModelAdapter, qa: QASet, count: int) -> None:
    layers = a.spec.num_layers
    stops = sorted({layers // 3, layers // 2, 2 * layers // 3, 3 * layers // 4, layers})
    overlap: dict[tuple[int, int], list[float]] = {}
    for i in range(0, len(qa.questions), 3)[:count]:
        att = _probe(a, _input(a, qa, i)[1])
        n = att.shape[1]
        for after, share in ((1, 0.4), (max(2, layers // 4), 0.15)):  # the default's two checks
            k = max(1, int(n * share))
            top = set(att[after + 1 :].sum(0).topk(k).indices.tolist())
            for stop in stops:
                got = set(att[after + 1 : stop].sum(0).topk(k).indices.tolist())
                overlap.setdefault((after, stop), []).append(len(top & got) / k)
    for (after, stop), v in sorted(overlap.items()):
        print(
            f"after layer {after}, probe through layer {stop - 1} of {layers - 1}: "
            f"{sum(v) / len(v):.3f} of the whole probe's top tokens (least {min(v):.3f}, {len(v)} prompts)"
        )


def products(a: ModelAdapter, rows_list: list[int], repeats: int) -> None:
    decoder = (m for n, m in a.model.named_modules() if "layers." in n and isinstance(m, torch.nn.Linear))
    w = max(decoder, key=lambda m: m.weight.numel()).weight.detach()
    copies = [w.clone() for _ in range(12)]
    quant = [quantize_int8(c, torch.float32) for c in copies]
    fast = [native.int8_kernel(q, s) for q, s in quant] if native.int8_available() else []
    act = torch.bfloat16 if w.dtype == torch.float32 else w.dtype
    for rows in rows_list:
        print(_product(w, copies, quant, fast, act, rows, repeats))


def _product(
    w: torch.Tensor,
    copies: list[torch.Tensor],
    quant: list[tuple[torch.Tensor, torch.Tensor]],
    fast: list[Callable[[torch.Tensor], torch.Tensor]],
    act: torch.dtype,
    rows: int,
    repeats: int,
) -> str:
    """One row count's line of :func:`products`."""
    x = torch.randn(rows, w.shape[1], dtype=w.dtype)
    model_ms = _best(lambda: [torch.nn.functional.linear(x, c) for c in copies], repeats) / len(copies)
    line = f"{tuple(w.shape)} x {rows} rows: {w.dtype} {model_ms:.3f} ms"
    if fast and rows <= native.NATIVE_MAX_ROWS:
        ms = _best(lambda: [k(x) for k in fast], repeats) / len(copies)
        return line + f", int8 (ragkv's kernel) {ms:.3f} ms"
    xa = x.to(act)
    ms = _best(lambda: [torch._weight_int8pack_mm(xa, q, s.to(act)) for q, s in quant], repeats) / len(copies)
    return line + f", int8 (torch's kernel) {ms:.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--phases", default="0,6,8,13", help="own-set prompt indices to time")
    ap.add_argument("--depth-prompts", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="phases,depth,products")
    args = ap.parse_args()
    a = load_model(args.model, device="cpu", dtype="auto")
    qa = load_qa_set(None)
    parts = set(args.parts.split(","))
    print(f"{a.name}, {a.dtype}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        if "phases" in parts:
            phases(a, qa, [int(i) for i in args.phases.split(",")], args.repeats)
        if "depth" in parts:
            depth(a, qa, args.depth_prompts)
        if "products" in parts:
            products(a, [1, 4, 8, 16, 20, 29, 64], max(10, args.repeats))


if __name__ == "__main__":
    main()
