"""Decode steps carried on prefill pieces (the scheduler's ``carry``) against steps of their own.

    python experiments/carry_steps.py --model M [--requests 8] [--tokens 32] [--rounds 2] [--context 1600]

The server's scheduler, driven in process (no HTTP): ``--requests`` full-prefill RAG prompts from
the stdlib set (about ``--context`` tokens each), greedy ``--tokens`` answer tokens each (end
tokens ignored, so every request decodes the same count), with ``concurrency`` requests in flight
(a new one is submitted when one finishes), at concurrency 1 and 4, carry off and on, interleaved
over ``--rounds``. Prints output tokens/s per setting, and the ratio concurrency 4 / concurrency 1.
Texts are compared between carry off and on (the same greedy answers, or the difference is said).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from ragkv.bench.fusion import builtin_prompts
from ragkv.driver import Event, Job, JobRequest, Scheduler
from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.embedder import HashingEmbedder


def _run(rag: RagKV, prompts: list[dict], concurrency: int, carry: bool, tokens: int, step: int):
    scheduler = Scheduler(rag.adapter, max_batch=concurrency, max_queue=64, step_tokens=step, carry=carry)
    scheduler.start()
    free = threading.Semaphore(concurrency)
    done = threading.Event()
    texts = [""] * len(prompts)
    left = [len(prompts)]
    lock = threading.Lock()

    def post_for(i: int):
        def post(event: Event) -> None:
            if event.kind == "delta":
                texts[i] += event.text
            elif event.kind in ("done", "error"):
                if event.kind == "error":
                    texts[i] = f"ERROR {event.error}"
                free.release()
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return post

    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        free.acquire()
        scheduler.submit(Job(JobRequest(rag, gen, "full", rag=(p["chunks"], p["question"])), post_for(i)))
    done.wait()
    wall = time.perf_counter() - t0
    scheduler.stop()
    return len(prompts) * tokens / wall, texts, scheduler.counters.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=1600)
    ap.add_argument("--step-tokens", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(model=args.model, data_dir=Path(tmp), store=("memory://", f"{tmp}/kv"))
        with RagKV(cfg, embedder=HashingEmbedder(dim=64)) as rag:
            prompts = builtin_prompts(rag.adapter, n=args.requests, max_tokens=args.context)
            print(
                f"model {args.model}, dtype {rag.adapter.dtype}, {args.requests} requests, "
                f"{args.tokens} tokens each, pieces of {args.step_tokens}"
            )
            rates: dict[tuple[int, bool], list[float]] = {}
            answers: dict[bool, list[str]] = {}
            for r in range(args.rounds):
                for conc in (1, 4):
                    for carry in (False, True) if r % 2 == 0 else (True, False):
                        rate, texts, counters = _run(rag, prompts, conc, carry, args.tokens, args.step_tokens)
                        rates.setdefault((conc, carry), []).append(rate)
                        answers.setdefault(carry, texts)
                        print(
                            f"round {r} c{conc} carry={carry}: {rate:.2f} tok/s; "
                            f"carried {counters['carried_steps']} of {counters['steps']} steps",
                            flush=True,
                        )
            for carry in (False, True):
                c1 = statistics.median(rates[(1, carry)])
                c4 = statistics.median(rates[(4, carry)])
                print(f"carry={carry}: c1 {c1:.2f} tok/s, c4 {c4:.2f} tok/s, c4/c1 {c4 / c1:.2f}")
            same = sum(a == b for a, b in zip(answers[False], answers[True], strict=True))
            print(f"answers equal with and without carry: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
