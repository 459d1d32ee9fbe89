"""``ragkv bench vllm``: vLLM alone against vLLM with ragkv's KV connector, on the same RAG prompts.

ragkv indexes the invented QA documents (``ragkv/bench/data/qa_invented.json``) with the model
folder vLLM serves; each question's prompt is ragkv's RAG layout over its top chunks, tokenized
whole (as a client's prompt reaches vLLM). One vLLM engine (prefix caching off, so every request
prefills) answers each prompt twice, greedily: with the connector, and opted out of it
(``kv_transfer_params={"ragkv": False}``), so the baseline is measured in the same run, on the same
engine. TTFT is a 1-token request's time; end-to-end a ``max_tokens`` one. A warm-up request first
loads ragkv's model copy (its time is reported on its own). vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the connector's counters and step times are readable.

vLLM is imported only here, lazily: it lives in its own virtual environment (``tools/vllm_env.sh``).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PHASES", "VllmBenchConfig", "VllmMissingError", "require_vllm", "run_vllm_bench"]

QA = Path(__file__).resolve().parent / "data" / "qa_invented.json"
# the connector's steps, as RagkvSide.phase_s names them (plan: the scheduler's check of the
# prompt's chunks and entries; the rest: the worker's load before the forward pass)
PHASES = ("plan", "prefix", "entries", "fusion", "extract", "write")


class VllmMissingError(RuntimeError):
    """vLLM is not importable here (it lives in a virtual environment of its own)."""


def require_vllm() -> None:
    """Raise :class:`VllmMissingError`, saying how to get vLLM, unless it can be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmMissingError(
            "vLLM is not installed in this environment; it lives in a virtual environment of its own: "
            "build it with `bash tools/vllm_env.sh --no-test` and run `.vllm-venv/bin/ragkv bench vllm` "
            "(see docs/vllm.md)"
        )


@dataclass(frozen=True, slots=True)
class VllmBenchConfig:
    """What ``ragkv bench vllm`` runs."""

    questions: int = 4  # QA questions, one RAG prompt each
    max_tokens: int = 32  # tokens of the end-to-end request
    docs: int = 10  # QA documents indexed
    fusion_ratio: float | None = None  # share of chunk tokens recomputed (None: ragkv's default)
    model: str | None = None  # a model folder vLLM loads (None: ragkv's default model, converted)

    def __post_init__(self) -> None:
        if self.questions < 1 or self.max_tokens < 1 or self.docs < 1:
            raise ValueError("questions, max_tokens and docs must each be >= 1")
        if self.fusion_ratio is not None and not 0.0 <= self.fusion_ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be within [0, 1]; got {self.fusion_ratio}")


def _model_folder(model: str | None) -> str:
    """A folder vLLM loads as is: ``model``, or ragkv's default model converted into its cache."""
    if model is not None:
        return model
    from ragkv.model import load_model
    from ragkv.model.loading import model_cache_dir

    load_model("smollm2-135m")  # converts the default model into the cache once
    return sorted(glob.glob(str(model_cache_dir() / "smollm2-135m-*")))[0]


def _index_and_prompts(cfg: VllmBenchConfig, folder: str, data_dir: Path) -> tuple[list[list[int]], str]:
    """Index the QA documents with ragkv; the prompts' token ids and the dtype ragkv ran in."""
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.model.placement import dtype_name
    from ragkv.retriever.documents import Document

    qa = json.loads(QA.read_text())
    with RagKV(EngineConfig(data_dir=data_dir, model=folder, device="cpu")) as engine:
        docs = [Document(f"qa:{d['id']}", d["text"], d["title"]) for d in qa["documents"][: cfg.docs]]
        engine.index(docs, progress=False)
        layout = engine.retriever.layout
        prompts = []
        for q in qa["questions"][: cfg.questions]:
            chunks = engine.retrieve(q["question"])
            text = layout.prefix + "".join(layout.chunk_text(c.text) for c in chunks)
            prompts.append(engine.adapter.encode(text + layout.suffix_text(q["question"])))
        return prompts, dtype_name(engine.adapter.dtype)


def _agreeing(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_vllm_bench(
    cfg: VllmBenchConfig, echo: Callable[[str], None] = lambda _: None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the benchmark: one row per prompt, and a summary (medians, warm-up, per-step times).

    Raises:
        VllmMissingError: vLLM is not installed here.
    """
    require_vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    folder = _model_folder(cfg.model)
    data_dir = Path(tempfile.mkdtemp(prefix="ragkv-bench-vllm-"))
    started = time.perf_counter()
    prompts, dtype = _index_and_prompts(cfg, folder, data_dir)
    echo(f"indexed {cfg.docs} documents in {time.perf_counter() - started:.1f} s (ragkv, {dtype})")
    extra: dict[str, Any] = {"data_dir": str(data_dir)}
    if cfg.fusion_ratio is not None:
        extra["fusion_ratio"] = cfg.fusion_ratio
    transfer = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    llm = LLM(model=folder, max_model_len=4096, enable_prefix_caching=False, kv_transfer_config=transfer)
    from ragkv.integrations import vllm as connector

    def run(ids: list[int], ragkv: bool, max_tokens: int) -> tuple[float, Any]:
        extra_args = None if ragkv else {"kv_transfer_params": {"ragkv": False}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra_args)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    warm_s, _ = run(prompts[0], True, 1)
    echo(f"warm-up (loads ragkv's model copy, first fusion): {warm_s:.2f} s")
    run(prompts[0], False, 1)
    (side,) = connector._SIDES.values()
    side.phase_s.clear()
    rows = [_measure(run, i, ids, cfg.max_tokens, connector.COUNTS) for i, ids in enumerate(prompts)]
    summary: dict[str, Any] = {
        "warm_up_s": round(warm_s, 2),
        "ragkv_dtype": dtype,
        "median_ttft_vllm_ms": statistics.median(r["ttft_vllm_ms"] for r in rows),
        "median_ttft_connector_ms": statistics.median(r["ttft_connector_ms"] for r in rows),
        # per request: every prompt ran through the connector twice (TTFT and end-to-end)
        "step_ms": {p: round(side.phase_s.get(p, 0.0) * 1000 / (2 * len(rows)), 1) for p in PHASES},
    }
    return rows, summary


def _measure(run: Callable[..., tuple[float, Any]], i: int, ids: list[int], max_tokens: int, counts: Any) -> dict:
    """One prompt: TTFT and end-to-end, with the connector and without, interleaved."""
    load_before = counts.load_s
    ttft_c, out_c = run(ids, True, 1)
    load_s = counts.load_s - load_before
    ttft_b, _ = run(ids, False, 1)
    e2e_c, full_c = run(ids, True, max_tokens)
    e2e_b, full_b = run(ids, False, max_tokens)
    base, got = list(full_b.outputs[0].token_ids), list(full_c.outputs[0].token_ids)
    return {
        "question": i + 1,
        "prompt_tokens": len(ids),
        "served_tokens": int(out_c.num_cached_tokens or 0),
        "ttft_vllm_ms": round(ttft_b * 1000, 1),
        "ttft_connector_ms": round(ttft_c * 1000, 1),
        "ragkv_load_ms": round(load_s * 1000, 1),
        "e2e_vllm_ms": round(e2e_b * 1000, 1),
        "e2e_connector_ms": round(e2e_c * 1000, 1),
        "agreeing_prefix": f"{_agreeing(base, got)}/{len(base)}",
    }
