"""LlamaIndex response modes: first and repeated query, ragkv reuse vs the plain model, in one run.

    python experiments/frameworks.py [--modes compact,refine | --quick] [--max-tokens 16] [--ratio 0.15]
                               [--answers] [--json rows.json]

Documents are the docstrings of a few stdlib modules (heapq, bisect, functools, textwrap), split
by LlamaIndex's SentenceSplitter and retrieved by a VectorStoreIndex (top 3, feature-hashing
embedder so that retrieval costs nothing here). Per response mode, a fresh engine (cold chunk
store) answers the same question twice: with ``RagKVLLM`` + ``RagKVNodePostprocessor`` (reuse)
and with ``RagKVLLM(reuse_chunks=False)`` and no postprocessor (the plain model). TTFT is the
user's (query start to the first token of the last LLM call, ``metadata["ragkv"]["ttft_ms"]``);
the first query's includes building the chunk caches. Decoding is greedy, so ``same answer`` (the
reuse answer equals the plain model's, second query) is deterministic: a "no" is fusion at the
chosen ratio (``--ratio 1.0`` recomputes every chunk token; all that still differs then is that
cached segments are tokenized on their own, see docs/integrations-llamaindex.md).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from ragkv.bench.table import Column, format_table

QUESTION = "How do I push an item onto a heap while keeping the heap invariant?"
MODULES = ("heapq", "bisect", "functools", "textwrap")
QUICK = ("compact", "refine")
MODES = ("compact", "refine", "tree_summarize", "simple_summarize", "accumulate", "compact_accumulate")


def documents() -> list[Any]:
    import importlib

    from llama_index.core import Document

    docs = []
    for name in MODULES:
        mod = importlib.import_module(name)
        parts = [inspect.getdoc(mod) or ""]
        for attr in sorted(getattr(mod, "__all__", dir(mod))):
            doc = inspect.getdoc(getattr(mod, attr, None))
            if doc and not attr.startswith("_"):
                parts.append(f"{name}.{attr}: {doc}")
        docs.append(Document(text="\n\n".join(parts)[:3000], metadata={"module": name}))
    return docs


def run_mode(
    adapter: Any, docs: list[Any], mode: str, reuse: bool, max_tokens: int, ratio: float | None = None
) -> list[dict[str, Any]]:
    """Two identical queries on a fresh engine; each row: user TTFT, wall time, reuse counters, answer."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter

    from ragkv.engine import EngineConfig, RagKV
    from ragkv.fusion import FusionConfig
    from ragkv.integrations.llamaindex import RagKVEmbedding, RagKVLLM, RagKVNodePostprocessor
    from ragkv.retriever.embedder import HashingEmbedder

    with (
        tempfile.TemporaryDirectory() as tmp,
        RagKV(
            EngineConfig(
                data_dir=Path(tmp),
                store=("memory://",),
                fusion=FusionConfig() if ratio is None else FusionConfig(ratio=ratio),
            ),
            adapter=adapter,
            embedder=HashingEmbedder(dim=256),
        ) as rag,
    ):
        index = VectorStoreIndex.from_documents(
            docs, embed_model=RagKVEmbedding(rag), transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)]
        )
        pp = [RagKVNodePostprocessor(rag, progress=False)] if reuse else []
        llm = RagKVLLM(rag, max_tokens=max_tokens, reuse_chunks=reuse)
        qe = index.as_query_engine(llm=llm, node_postprocessors=pp, similarity_top_k=3, response_mode=mode)
        rows = []
        for _ in range(2):
            t0 = time.perf_counter()
            response = qe.query(QUESTION)
            s = (response.metadata or {})["ragkv"]
            rows.append({**s, "wall_ms": (time.perf_counter() - t0) * 1000, "answer": str(response)})
        return rows


COLUMNS = (
    Column("mode"),
    Column("calls"),
    Column("prompt_tokens", "prompt tok"),
    Column("plain_1st_ms", "plain 1st", "{:,.0f}"),
    Column("plain_2nd_ms", "plain 2nd", "{:,.0f}"),
    Column("reuse_1st_ms", "reuse 1st", "{:,.0f}"),
    Column("build_ms", "reuse 1st: cache build", "{:,.0f}"),
    Column("reuse_2nd_ms", "reuse 2nd", "{:,.0f}"),
    Column("llm_ttft_ms", "reuse 2nd: last call", "{:,.0f}"),
    Column("speedup_1st", "1st: plain/reuse", "{:.2f}x"),
    Column("speedup_2nd", "2nd: plain/reuse", "{:.2f}x"),
    Column("reused_tokens", "reused tok"),
    Column("same_answer", "same answer"),
)


def mode_row(mode: str, plain: list[dict[str, Any]], reuse: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from a mode's two plain and two reuse queries (TTFTs are the user's)."""
    p1, p2, r1, r2 = plain[0], plain[1], reuse[0], reuse[1]
    return {
        "mode": mode,
        "calls": r2["llm_calls"],
        "prompt_tokens": r2["prompt_tokens"],
        "plain_1st_ms": p1["ttft_ms"],
        "plain_2nd_ms": p2["ttft_ms"],
        "reuse_1st_ms": r1["ttft_ms"],
        "build_ms": r1["cache_build_ms"],
        "reuse_2nd_ms": r2["ttft_ms"],
        "llm_ttft_ms": r2["llm_ttft_ms"],
        "speedup_1st": p1["ttft_ms"] / max(r1["ttft_ms"], 1e-9),
        "speedup_2nd": p2["ttft_ms"] / max(r2["ttft_ms"], 1e-9),
        "reused_tokens": r2["reused_tokens"],
        # greedy decoding: a different answer is fusion at the chosen ratio, not chance
        "same_answer": "yes" if r2["answer"] == p2["answer"] else "no",
        "plain_answer": p2["answer"],
        "reuse_answer": r2["answer"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK)} (one single-call, one multi-call)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=None, help="fusion recompute ratio (default: the engine's)")
    ap.add_argument("--answers", action="store_true", help="print each mode's plain and reuse answers")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (answers and raw stats too) to this file")
    args = ap.parse_args()
    modes = list(QUICK) if args.quick else args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; pick from {','.join(MODES)}")
    logging.getLogger("ragkv").setLevel(logging.ERROR)

    import torch

    from ragkv.model import load_model

    adapter = load_model()
    docs = documents()
    run_mode(adapter, docs, "compact", False, 2)  # warm the model and the framework up
    print(f"model {adapter.name}, {torch.get_num_threads()} torch threads, max_tokens {args.max_tokens}", flush=True)
    rows, raw = [], []
    for mode in modes:
        plain = run_mode(adapter, docs, mode, False, args.max_tokens)
        reuse = run_mode(adapter, docs, mode, True, args.max_tokens, args.ratio)
        rows.append(mode_row(mode, plain, reuse))
        raw.append({"mode": mode, "plain": plain, "reuse": reuse})
        print(f"{mode}: done", flush=True)
    print(format_table(rows, COLUMNS))
    if args.answers:
        for row in rows:
            print(f"{row['mode']}\n  plain: {row['plain_answer']!r}\n  reuse: {row['reuse_answer']!r}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "runs": raw}, indent=1, default=str))


if __name__ == "__main__":
    main()
