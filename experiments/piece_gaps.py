"""Prefill pieces sized in tokens against pieces sized in time: the gaps streams see, and TTFT.

    python experiments/piece_gaps.py --model M [--requests 10] [--rate 0.15] [--tokens 48] [--rounds 2]
        [--configs tokens:256,ms:250,ms:500,ms:1000] [--prompt-set builtin|packages] [--json out.json]

The server's scheduler, driven in process (no HTTP): ``--requests`` RAG prompts (chunks indexed
first, so each request loads its chunk caches and fuses them, the server's default path), greedy
``--tokens`` answer tokens each (end tokens ignored), arriving as a seeded Poisson process at
``--rate`` requests/s, the same arrivals and prompts for every configuration, configurations
interleaved over ``--rounds``. ``tokens:N`` is ``step_tokens=N`` (the server before time-sized
pieces); ``ms:T`` is ``step_ms=T``. Prints per configuration (medians over rounds): p50/p95 TTFT,
p95 and max gap between two pieces of a stream's text, output tokens/s over the span, and the
scheduler's piece counters; the greedy texts are compared with the first configuration's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ragkv.bench.fusion import builtin_prompts
from ragkv.driver import Event, Job, JobRequest, Scheduler
from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.embedder import HashingEmbedder


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _run(rag: RagKV, prompts: list[dict], arrivals: list[float], config: str, tokens: int) -> dict[str, Any]:
    kind, value = config.split(":")
    step_tokens = int(value) if kind == "tokens" else 256
    step_ms = float(value) if kind == "ms" else None
    scheduler = Scheduler(
        rag.adapter, max_batch=8, max_queue=64, decode_weights=rag.decode_weights, step_tokens=step_tokens,
        step_ms=step_ms,
    )  # fmt: skip
    scheduler.start()
    n = len(prompts)
    sent = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    texts = [""] * n
    left = [n]
    done = threading.Event()
    lock = threading.Lock()

    def post_for(i: int):
        def post(event: Event) -> None:
            now = time.perf_counter()
            if event.kind == "delta":
                times[i].append(now)
                texts[i] += event.text or ""
            elif event.kind in ("done", "error"):
                if event.kind == "error":
                    texts[i] = f"ERROR {event.error}"
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return post

    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        sent[i] = time.perf_counter()
        scheduler.submit(Job(JobRequest(rag, gen, "reuse", rag=(p["chunks"], p["question"])), post_for(i)))
    done.wait()
    end = max(t[-1] for t in times if t)
    scheduler.stop()
    ttft = [(t[0] - s) * 1000 for t, s in zip(times, sent, strict=True) if t]
    gaps = [(b - a) * 1000 for t in times for a, b in zip(t, t[1:], strict=False)]
    return {
        "config": config,
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p95_ms": _pct(ttft, 0.95),
        "gap_p95_ms": _pct(gaps, 0.95),
        "gap_max_ms": max(gaps) if gaps else float("nan"),
        "tok_s": n * tokens / (end - t0),
        "piece_tokens": scheduler.piece_tokens,
        "counters": scheduler.counters.as_dict(),
        "texts": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0.15)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--configs", default="tokens:256,ms:250,ms:500,ms:1000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    configs = args.configs.split(",")
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(model=args.model, data_dir=Path(tmp), store=("memory://", f"{tmp}/kv"))
        with RagKV(cfg, embedder=HashingEmbedder(dim=64)) as rag:
            prompts = builtin_prompts(rag.adapter, n=args.requests, max_tokens=args.context)
            print(
                f"model {args.model}, dtype {rag.adapter.dtype}, decode {rag.decode_weights}, "
                f"{args.requests} requests at {args.rate}/s, {args.tokens} tokens each",
                flush=True,
            )
            _run(rag, prompts, [0.0] * len(prompts), configs[0], 1)  # warm-up: every chunk cache stored
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for r in range(args.rounds):
                for config in configs if r % 2 == 0 else configs[::-1]:
                    res = _run(rag, prompts, arrivals, config, args.tokens)
                    runs[config].append(res)
                    c = res["counters"]
                    print(
                        f"round {r} {config}: TTFT p50 {res['ttft_p50_ms']:.0f} p95 {res['ttft_p95_ms']:.0f} ms, "
                        f"gap p95 {res['gap_p95_ms']:.0f} max {res['gap_max_ms']:.0f} ms, {res['tok_s']:.2f} tok/s, "
                        f"piece {res['piece_tokens']} tok; pieces while decoding {c['decoding_pieces']} "
                        f"({c['decoding_piece_ms']:.0f} ms mean, {c['max_decoding_piece_ms']:.0f} max)",
                        flush=True,
                    )
            first = runs[configs[0]][0]["texts"]
            summary = []
            for config in configs:
                rows = runs[config]
                med = {k: statistics.median(r[k] for r in rows) for k in
                       ("ttft_p50_ms", "ttft_p95_ms", "gap_p95_ms", "gap_max_ms", "tok_s")}  # fmt: skip
                same = sum(a == b for a, b in zip(first, rows[0]["texts"], strict=True))
                summary.append({"config": config, **med, "same_text": same})
                print(
                    f"{config:>12}: TTFT p50 {med['ttft_p50_ms']:7.0f} p95 {med['ttft_p95_ms']:7.0f} ms | gap p95 "
                    f"{med['gap_p95_ms']:6.0f} max {med['gap_max_ms']:6.0f} ms | {med['tok_s']:.2f} tok/s | "
                    f"same text as {configs[0]}: {same}/{len(first)}"
                )
            if args.json:
                for results in runs.values():
                    for res in results:
                        res.pop("texts")
                args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                                 "summary": summary, "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
