"""The connector's fusion timed in one process in several places: before vLLM starts, after it (a
second model copy, the connector's own copy in the main thread and in a fresh thread), and in
vLLM's step. Run in vLLM's venv (bash tools/vllm_env.sh --no-test):

    OMP_NUM_THREADS=2 .vllm-venv/bin/python experiments/vllm_fusion_place.py --questions 6

docs/benchmarks.md ("vLLM connector", the AVX-512 part) quotes three runs of it: medians that move
between runs more than between places.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from ragkv.bench import vllm as bench  # noqa: E402
from ragkv.cache.catalog import Catalog  # noqa: E402
from ragkv.cache.store import open_store  # noqa: E402
from ragkv.integrations._vllm_config import build_side, engine_config  # noqa: E402
from ragkv.model import load_model  # noqa: E402


def timed(side: Any, questions: list[Any], label: str) -> None:
    """Median ms of ``side.fused_kv`` over the questions (after one warm-up)."""
    side.fused_kv(questions[0].ids, side.plan(questions[0].ids, 0, 128))
    times = []
    for q in questions:
        plan = side.plan(q.ids, 0, 128)
        t = time.perf_counter()
        side.fused_kv(q.ids, plan)
        times.append(time.perf_counter() - t)
    each = [round(x * 1000) for x in times]
    print(f"{label}: median {statistics.median(times) * 1000:.0f} ms {each} {side.fused_on}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    cfg = bench.VllmBenchConfig(questions=args.questions, max_tokens=1, model=args.model)
    folder = bench._model_folder(cfg.model)
    data_dir = Path(tempfile.mkdtemp(prefix="ragkv-fusion-place-"))
    questions, plain = bench._ragkv_alone(cfg, folder, data_dir, print)
    config = engine_config(folder, bench._extra(cfg, data_dir))
    store, catalog = open_store(config.store_urls()), Catalog(config.catalog_url())
    own = build_side(load_model(folder, dtype="auto"), store, catalog, config)
    timed(own, questions, "before vLLM")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from ragkv.integrations import vllm as connector

    transfer = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=bench._extra(cfg, data_dir),
    )
    llm = LLM(model=folder, dtype=plain["dtype"], max_model_len=4096, enable_prefix_caching=False,
              kv_transfer_config=transfer)  # fmt: skip
    timed(own, questions, "after vLLM, a second copy")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=questions[0].ids)], params, use_tqdm=False)
    (side,) = connector._SIDES.values()
    timed(side, questions, "after vLLM, the connector's copy, main thread")

    def pin() -> None:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        torch._C.set_num_threads(len(os.sched_getaffinity(0)))

    with ThreadPoolExecutor(1, initializer=pin) as pool:
        pool.submit(timed, side, questions, "the connector's copy, a fresh thread").result()
    side.phase_s.clear()
    for q in questions:
        llm.generate([TokensPrompt(prompt_token_ids=q.ids)], params, use_tqdm=False)
    steps = {k: round(v * 1000 / len(questions)) for k, v in side.phase_s.items()}
    print(f"in vLLM's step (ms per request): {steps} {side.fused_on}")


if __name__ == "__main__":
    main()
