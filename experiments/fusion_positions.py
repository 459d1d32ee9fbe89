"""Where the tokens fusion keeps recomputing sit in the context, and what cutting keys by query block saves.

For the own QA set's first questions: the final selection's positions as shares of the fused
context (mean, quartiles), and the attention work left if the selected queries, sorted and split
into four blocks, each attended only to the keys up to its block's last position (share of the
work over every key, which torch's CPU kernel does with a mask).

    python experiments/fusion_positions.py --questions 4

docs/benchmarks.md ("vLLM connector", the AVX-512 part) quotes one run on SmolLM2-135M in bf16.
"""

from __future__ import annotations

import argparse

import torch

from ragkv.bench.qa_data import build_prompt, load_qa_set
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    a = load_model(args.model, device="cpu", dtype="auto")
    qa = load_qa_set(None)
    for i in range(args.questions):
        p = build_prompt(qa, qa.questions[i], lambda t: len(a.encode(t)))
        prefix, chunks, suffix = a.chat_segments(p.get("system"), p["chunks"], p["question"])
        pre = a.prefill_kv(prefix)
        cached = [a.prefill_kv(c, past=[pre]) for c in chunks]
        out = fuse(a, FusionInput(pre, cached, chunks, suffix), FusionConfig(), prefill_suffix=True)
        n, sel = out.num_tokens, out.selected.float()
        ordered, _ = torch.sort(sel)
        cut = sum(float(b.max() + 1) * len(b) for b in torch.tensor_split(ordered, args.blocks) if len(b))
        quartiles = [round(float(q) / n, 2) for q in torch.quantile(sel, torch.tensor([0.25, 0.5, 0.75]))]
        print(f"q{i + 1:02d}: context {n}, selected {len(sel)}, mean position {float(sel.mean()) / n:.2f}, "
              f"quartiles {quartiles}, keys left by the cut {cut / (len(sel) * n):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
