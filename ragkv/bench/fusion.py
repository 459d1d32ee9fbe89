"""``ragkv bench fusion``: fidelity and TTFT of fusion methods against full prefill, in one run.

Per prompt: chunk caches are precomputed after the shared prefix (index time, not timed). Full
prefill gives the reference greedy answer (32 tokens) and its logits. Each method fuses the
cached chunks, prefills the suffix and picks the first token (its TTFT, caches already in
memory); then its logits at the positions predicting the reference answer give KL(full || method)
and top-1 agreement, and its own greedy answer gives exact match and token F1 against full's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ragkv.bench import table
from ragkv.bench.table import Column
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.generation import GenerationConfig, decode_loop
from ragkv.model import ModelAdapter
from ragkv.model.attention import DecodeWeights
from ragkv.model.batch import one_row
from ragkv.selection import StrategyParams

logger = logging.getLogger(__name__)

ANSWER_TOKENS = 32
DEFAULT_GRID: list[tuple[str, float]] = [
    ("naive", 0.0),
    ("blend", 0.15),
    ("blend", 0.3),
    ("query_focus", 0.1),
    ("query_focus", 0.15),
    ("query_focus", 0.2),
    ("full", 1.0),
]
KEYS = ("method", "recompute_ratio", "kl", "top1", "exact_match", "f1", "ttft_ms", "ttft_ratio")


def parse_grid(spec: str) -> list[tuple[str, float]]:
    """``"blend:0.15,query_focus:0.2,naive"`` -> [("blend", 0.15), ("query_focus", 0.2), ("naive", 0.0)]."""
    out = []
    for part in spec.split(","):
        name, _, ratio = part.strip().partition(":")
        out.append((name, float(ratio) if ratio else 0.0))
        FusionConfig(*out[-1])  # an unknown method or a ratio out of range: ValueError before any model loads
    return out


def fit_chunks(start: int, chunks: list[list[int]], tokens: int) -> list[list[int]]:
    """The leading ``chunks`` that fit whole in ``tokens`` after ``start`` tokens; the first is kept,
    cut to fit, even when it alone is too long."""
    kept: list[list[int]] = []
    n = start
    for c in chunks:
        if n + len(c) > tokens and kept:
            break
        kept.append(c[: tokens - n])
        n += len(kept[-1])
    return kept


def builtin_prompts(adapter: ModelAdapter, n: int = 12, max_tokens: int = 2800) -> list[dict[str, Any]]:
    """RAG prompts from stdlib documentation: 4-6 chunks of 300-512 tokens, about 1.5-2.8K tokens each.

    Chunks come from different modules (as a retriever mixing sources would return them), and
    the question asks about one of them.
    """
    from ragkv.retriever.chunker import Chunker, ChunkerConfig
    from ragkv.retriever.corpus import stdlib_corpus

    chunker = Chunker(lambda t: len(adapter.encode(t)), ChunkerConfig(min_tokens=300, max_tokens=512))
    per_doc = [[(d.source, s.text) for s in chunker.split(d.text)] for d in stdlib_corpus()]
    prompts = []
    for i in range(n):
        k = 4 + i % 3  # 4..6 chunks
        picks = []
        for j in range(k):  # round-robin over modules, a different chunk of each per prompt
            doc = per_doc[(i + j * 3) % len(per_doc)]
            picks.append(doc[(i // len(per_doc) + j) % len(doc)])
        while sum(len(adapter.encode(t)) for _, t in picks) > max_tokens and len(picks) > 2:
            picks.pop()
        src = picks[i % len(picks)][0].split(":")[-1]
        question = f"According to the documents, what is the {src} module for? Name one function it has."
        prompts.append({"system": None, "chunks": [t for _, t in picks], "question": question})
    return prompts


def _f1(a: Sequence[int], b: Sequence[int]) -> float:
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


def _kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    return float(kl), float(top1)


def _answer_logits(
    adapter: ModelAdapter, cache: Any, prompt_logits: torch.Tensor, answer: Sequence[int], start: int
) -> torch.Tensor:
    """Logits ``[len(answer), vocab]`` predicting each answer token: the prompt's last, then the answer's own.

    A one-token answer needs no forward pass (and an empty one would fail in the model).
    """
    if len(answer) <= 1:
        return prompt_logits[-1:]
    return torch.cat([prompt_logits[-1:], adapter.forward(answer[:-1], cache, start)])[: len(answer)]


def _greedy(
    adapter: ModelAdapter,
    cache: Any,
    logits: torch.Tensor,
    start: int,
    gen: GenerationConfig,
    decode_weights: DecodeWeights | None,
) -> list[int]:
    """Greedy answer ids after a prompt of ``start`` tokens in ``cache`` (its last ``logits`` ``[vocab]``)."""
    if decode_weights is None:
        return list(decode_loop(adapter, cache, logits, start, gen))
    step = one_row(adapter, cache, start, gen.max_new_tokens, decode_weights)
    return list(decode_loop(adapter, cache, logits, start, gen, step=step))


@torch.inference_mode()
def compare_methods(
    adapter: ModelAdapter,
    prompt: Mapping[str, Any],
    grid: Sequence[tuple[str, float] | tuple[str, float, StrategyParams | None]],
    scores: Sequence[torch.Tensor] | None = None,
    *,
    answer_tokens: int = ANSWER_TOKENS,
    decode_weights: DecodeWeights | None = None,
) -> list[dict]:
    """One prompt, every (method, ratio[, params]) of ``grid`` against full prefill: one row per entry, in order.

    Rows hold :data:`KEYS` and ``answer`` (the method's greedy answer ids, at most ``answer_tokens``;
    full prefill's own for ``full``), so a caller can score the answers (``ragkv bench qa``).
    ``decode_weights``: the answers are decoded by decode steps reading these weights (as an
    answer does: ``ragkv.model.batch``; an int8/int4 copy, say); None: the model's own forward.
    KL and top-1 always compare the model's own logits. ``scores``: per chunk, the deviation
    recorded at index time, for methods that rank by it (``experiments/craft.py``).
    """
    prefix, chunks, suffix = adapter.chat_segments(prompt.get("system"), prompt["chunks"], prompt["question"])
    ctx = prefix + [t for c in chunks for t in c]
    n = len(ctx)
    adapter.check_context(n + len(suffix) + answer_tokens)
    gen = GenerationConfig(max_new_tokens=answer_tokens)

    t0 = time.perf_counter()
    cache = adapter.build_cache([])
    logits = adapter.forward(ctx + suffix, cache, 0, logits="last")  # as an engine: no LM head over the prompt
    first = int(logits[-1].argmax())
    full_ttft = (time.perf_counter() - t0) * 1000
    answer = _greedy(adapter, cache, logits[-1], n + len(suffix), gen, decode_weights) or [first]
    adapter.crop_cache(cache, n + len(suffix))
    ref = _answer_logits(adapter, cache, logits, answer, n + len(suffix))

    pre = adapter.prefill_kv(prefix)
    cached = [adapter.prefill_kv(c, past=[pre]) for c in chunks]  # index time: each chunk alone
    rows = []
    for method, ratio, *extra in grid:
        if method == "full":
            rows.append(
                dict(
                    method="full",
                    recompute_ratio=1.0,
                    kl=0.0,
                    top1=1.0,
                    exact_match=1.0,
                    f1=1.0,
                    ttft_ms=full_ttft,
                    ttft_ratio=1.0,
                    answer=answer,
                )
            )
            continue
        cfg = FusionConfig(method=method, ratio=ratio, params=extra[0] if extra else None)
        t0 = time.perf_counter()
        inp = FusionInput(pre, cached, chunks, suffix, stored_scores=scores)
        fused = fuse(adapter, inp, cfg, prefill_suffix=True, logits="last")  # as the answer path
        assert fused.suffix_logits is not None
        logits = fused.suffix_logits
        int(logits[-1].argmax())
        ttft = (time.perf_counter() - t0) * 1000
        own = _greedy(adapter, fused.cache, logits[-1], n + len(suffix), gen, decode_weights)
        adapter.crop_cache(fused.cache, n + len(suffix))
        got = _answer_logits(adapter, fused.cache, logits, answer, n + len(suffix))
        kl, top1 = _kl_top1(ref, got)
        rows.append(
            dict(
                method=method,
                recompute_ratio=fused.recomputed_tokens / max(1, fused.chunk_tokens),
                kl=kl,
                top1=top1,
                exact_match=float(own == answer),
                f1=_f1(own, answer),
                ttft_ms=ttft,
                ttft_ratio=ttft / full_ttft,
                answer=own,
            )
        )
    return rows


def run_fusion_bench(
    adapter: ModelAdapter,
    prompts: list[dict[str, Any]] | None = None,
    grid: Sequence[tuple[str, float]] = tuple(DEFAULT_GRID),
    *,
    limit: int = 12,
) -> list[dict]:
    """Rows (keys ``KEYS``) averaged over prompts, one per (method, ratio) in ``grid``."""
    prompts = (prompts or builtin_prompts(adapter, n=limit))[:limit]
    grid = list(grid)
    if not any(m == "full" for m, _ in grid):
        grid.append(("full", 1.0))
    if not any(m == "naive" for m, _ in grid):
        grid.insert(0, ("naive", 0.0))
    compare_methods(adapter, {"chunks": ["warm up the kernels."], "question": "ok?"}, [("blend", 0.5)])
    per: dict[tuple[str, float], list[dict]] = {}
    for p in tqdm(prompts, desc="fusion bench", unit="prompt"):
        for (m, r), row in zip(grid, compare_methods(adapter, p, grid), strict=True):
            per.setdefault((m, r), []).append(row)
    out = []
    for (m, _r), rows in per.items():
        avg = {k: sum(row[k] for row in rows) / len(rows) for k in KEYS[1:]}
        out.append({"method": m, **{k: round(v, 5) for k, v in avg.items()}})
    return out


TABLE = (
    Column("method"),
    Column("recompute_ratio", "recompute", "{:.3f}"),
    Column("kl", "KL", "{:.4f}"),
    Column("top1", "top1", "{:.3f}"),
    Column("exact_match", "exact", "{:.2f}"),
    Column("f1", "F1", "{:.2f}"),
    Column("ttft_ms", "TTFT ms", "{:.0f}"),
    Column("ttft_ratio", "ratio", "{:.3f}"),
)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The fusion bench's rows as a Markdown table (:data:`TABLE`'s columns)."""
    return table.format_table(rows, TABLE)


def plot_rows(rows: list[dict], path: Path) -> None:
    """KL against ttft_ratio, one point per (method, ratio)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["ttft_ratio"], r["kl"])
        ax.annotate(f"{r['method']} {r['recompute_ratio']:.2f}", (r["ttft_ratio"], r["kl"]), fontsize=7)
    ax.set_xlabel("TTFT / full prefill")
    ax.set_ylabel("mean KL(full || method)")
    ax.set_title("ragkv fusion: fidelity vs cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
