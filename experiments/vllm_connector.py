"""vLLM alone vs vLLM with ragkv's KV connector: TTFT and end-to-end time on the same RAG prompts.

    .vllm-venv/bin/python experiments/vllm_connector.py [--questions 4] [--max-tokens 32] [--ratio 0.15]
                                                  [--docs 10] [--json rows.json]

Runs in vLLM's own venv (``bash tools/vllm_env.sh --no-test`` builds it). ragkv indexes the
invented QA documents (``ragkv/bench/data/qa_invented.json``) with the default model, converted to
a folder vLLM loads as is; each question's prompt is ragkv's RAG layout over its top-4 chunks,
tokenized whole (as a client's prompt reaches vLLM). One vLLM engine (prefix caching off, so every
request prefills) answers each prompt twice, greedily: with the connector, and opted out of it
(``kv_transfer_params={"ragkv": False}``): the baseline is measured in the same run, on the same
engine. TTFT is the time of a 1-token request; end-to-end of a ``--max-tokens`` one. A warm-up
request first loads ragkv's model copy (its time is printed on its own).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

QA = Path(__file__).resolve().parent.parent / "ragkv" / "bench" / "data" / "qa_invented.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=0.15, help="fusion ratio (share of chunk tokens recomputed)")
    ap.add_argument("--docs", type=int, default=10, help="documents indexed")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connector's counters are readable here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from ragkv.bench.table import Column, format_table
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.model import load_model
    from ragkv.model.loading import model_cache_dir
    from ragkv.retriever.documents import Document

    load_model("smollm2-135m")  # makes sure the converted folder exists
    folder = sorted(glob.glob(str(model_cache_dir() / "smollm2-135m-*")))[0]
    qa = json.loads(QA.read_text())
    data_dir = Path(tempfile.mkdtemp(prefix="ragkv-bench-vllm-"))
    engine = RagKV(EngineConfig(data_dir=data_dir, model=folder, device="cpu"))
    started = time.perf_counter()
    engine.index([Document(f"qa:{d['id']}", d["text"], d["title"]) for d in qa["documents"][: args.docs]])
    print(f"indexed {args.docs} documents in {time.perf_counter() - started:.1f} s (ragkv, {engine.adapter.dtype})")
    layout = engine.retriever.layout
    prompts = []
    for q in qa["questions"][: args.questions]:
        chunks = engine.retrieve(q["question"])
        text = layout.prefix + "".join(layout.chunk_text(c.text) for c in chunks) + layout.suffix_text(q["question"])
        prompts.append(engine.adapter.encode(text))
    engine.close()

    transfer = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"data_dir": str(data_dir), "fusion_ratio": args.ratio},
    )
    llm = LLM(model=folder, max_model_len=4096, enable_prefix_caching=False, kv_transfer_config=transfer)
    from ragkv.integrations.vllm import COUNTS

    def run(ids: list[int], ragkv: bool, max_tokens: int) -> tuple[float, Any]:
        extra = None if ragkv else {"kv_transfer_params": {"ragkv": False}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    warm_s, _ = run(prompts[0], True, 1)
    print(f"warm-up (loads ragkv's model copy, first fusion): {warm_s:.2f} s")
    run(prompts[0], False, 1)
    rows: list[dict[str, Any]] = []
    for i, ids in enumerate(prompts):
        load_before = COUNTS.load_s
        ttft_c, out_c = run(ids, True, 1)
        load_s = COUNTS.load_s - load_before
        ttft_b, _ = run(ids, False, 1)
        e2e_c, full_c = run(ids, True, args.max_tokens)
        e2e_b, full_b = run(ids, False, args.max_tokens)
        a, b = list(full_b.outputs[0].token_ids), list(full_c.outputs[0].token_ids)
        agree = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        rows.append(
            {
                "question": i + 1,
                "prompt_tokens": len(ids),
                "served_tokens": int(out_c.num_cached_tokens or 0),
                "ttft_vllm_ms": round(ttft_b * 1000, 1),
                "ttft_connector_ms": round(ttft_c * 1000, 1),
                "ragkv_fusion_ms": round(load_s * 1000, 1),
                "e2e_vllm_ms": round(e2e_b * 1000, 1),
                "e2e_connector_ms": round(e2e_c * 1000, 1),
                "agreeing_prefix": f"{agree}/{len(a)}",
            }
        )
    print(format_table(rows, [Column(k) for k in rows[0]]))
    med = {k: statistics.median(float(r[k]) for r in rows) for k in ("ttft_vllm_ms", "ttft_connector_ms")}
    print(f"median TTFT: vLLM {med['ttft_vllm_ms']:.0f} ms, vLLM + connector {med['ttft_connector_ms']:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
