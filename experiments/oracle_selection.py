"""How right can a 15% recompute be? Selection ranked by the true deviation, known from full prefill.

Issue 36: on Qwen2.5 0.5B the default (``query_focus`` at 15%) loses 2-3 questions of 36 to full
prefill, and on those it gives naive reuse's answer word for word; 30-70% recomputed repairs them
(docs/benchmarks.md, "The 0.5B's losses in bf16"). Is that the ranking's fault or the budget's?

Here every chunk's *true* deviation is known: the prompt is prefilled for real (each chunk after
the chunks before it, as full prefill sees it) and each token scored by how far its real K/V lie
from its cached K/V re-rotated to the same place (``experiments/craft.py``'s ``record_deviation``
with the prompt's own preceding chunks as the context: an oracle no query-time method has). Then
``craft`` (the oracle deviation alone) and ``craft_query`` (times the question's attention, as
``query_focus`` weights its measured deviation) recompute the top share, beside the default:

    python experiments/oracle_selection.py --model ~/.cache/ragkv-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --only q03,q13,q15,q05 --methods "full,naive,default,craft:0.15,craft_query:0.15,craft_query:0.3"

If the oracle ranking at 15% gives full prefill's answers where the default does not, a better
query-time ranking can; if it does not, the 0.5B needs a larger budget, whatever the ranking.
Prints one line per question and method and a summary; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from craft import record_deviation  # registers craft and craft_query

from ragkv.bench.fusion import compare_methods
from ragkv.bench.qa import parse_methods
from ragkv.bench.qa_data import build_prompt, load_qa_set
from ragkv.bench.qa_score import contains_answer
from ragkv.model import ModelAdapter, load_model


@torch.inference_mode()
def oracle_scores(adapter: ModelAdapter, prompt: Mapping[str, Any]) -> list[torch.Tensor]:
    """Per chunk, each token's true deviation: its cache placed after the prompt's own preceding chunks."""
    prefix, chunks, _ = adapter.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    pre = adapter.prefill_kv(prefix)
    out: list[torch.Tensor] = []
    before: list[int] = []
    for ids in chunks:
        cached = adapter.prefill_kv(ids, past=[pre])
        out.append(record_deviation(adapter, pre, cached, ids, [before] if before else []))
        before = [*before, *ids]
    return out


@torch.inference_mode()
def full_margin(adapter: ModelAdapter, prompt: Mapping[str, Any], full: list[int], got: list[int]) -> float | None:
    """How much full prefill prefers its own answer where ``got`` first departs from it: the log-probability
    of full prefill's token minus that of ``got``'s, in nats, under full prefill (None: the same answer,
    or one ends where the other goes on)."""
    d = next((i for i, (a, b) in enumerate(zip(full, got, strict=False)) if a != b), None)
    if d is None:
        return None
    prefix, chunks, suffix = adapter.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    ids = prefix + [t for c in chunks for t in c] + suffix + full[:d]
    logp = torch.log_softmax(adapter.forward(ids, adapter.build_cache([]), 0)[-1].float(), -1)
    return round(float(logp[full[d]] - logp[got[d]]), 3)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--qa-set", default=None)
    ap.add_argument("--only", default="")
    ap.add_argument("--methods", default="full,naive,default,craft:0.15,craft_query:0.15")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    adapter = load_model(args.model)
    qa = load_qa_set(args.qa_set)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    methods = parse_methods(args.methods)
    grid = [m.grid_entry() for m in methods]
    rows = []
    for q in qa.questions:
        if only and q.id not in only:
            continue
        prompt = build_prompt(qa, q, lambda t: len(adapter.encode(t)))
        scores = oracle_scores(adapter, prompt)
        results = compare_methods(adapter, prompt, grid, scores, answer_tokens=args.max_tokens)
        full_ids = next(r["answer"] for r in results if r["method"] == "full")
        for m, r in zip(methods, results, strict=True):
            text = adapter.decode(r["answer"]).strip()
            row = dict(
                id=q.id,
                method=m.label,
                answer=text,
                correct=contains_answer(text, q.answers),
                same_as_full=r["exact_match"],
                kl=r["kl"],
                recompute=r["recompute_ratio"],
                ttft_ratio=r["ttft_ratio"],
                full_margin=full_margin(adapter, prompt, full_ids, r["answer"]),
            )
            rows.append(row)
            print(
                f"{q.id} {m.label:32} right={int(row['correct'])} same={int(row['same_as_full'])} "
                f"kl={row['kl']:.4f} rec={row['recompute']:.3f} margin={row['full_margin']} | {text[:60]!r}",
                flush=True,
            )
    print("\nmethod | right | same as full | mean KL")
    for m in methods:
        mine = [r for r in rows if r["method"] == m.label]
        print(
            f"{m.label:32} | {sum(r['correct'] for r in mine)}/{len(mine)} | "
            f"{sum(r['same_as_full'] for r in mine):.0f}/{len(mine)} | {statistics.mean(r['kl'] for r in mine):.4f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": adapter.name, "qa_set": qa.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
