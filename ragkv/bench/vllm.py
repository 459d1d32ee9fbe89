"""``ragkv bench vllm``: vLLM alone against vLLM with ragkv's KV connector, on the same RAG prompts.

ragkv indexes the invented QA documents (``ragkv/bench/data/qa_invented.json``) with the model
folder vLLM serves; each question's prompt is ragkv's RAG layout over its top chunks, tokenized
whole (as a client's prompt reaches vLLM). Before vLLM starts, ragkv alone answers each question
in this process (full prefill and its default fusion: TTFT and greedy answers), and the
connector's own ragkv side fuses each prompt's ids here too, step by step: the reference for the
same steps inside vLLM. Then one vLLM engine (prefix caching off, so every request prefills; the
dtype ragkv runs in unless told otherwise) answers each prompt twice, greedily: with the
connector, and opted out of it (``kv_transfer_params={"ragkv": False}``), so the baseline is
measured in the same run, on the same engine. TTFT is a 1-token request's time; end-to-end a
``max_tokens`` one. With ``concurrency`` > 1 a last phase sends the prompts in waves of that many
at once, each side in turn (requests per second). A warm-up request first loads ragkv's model copy
(its time is reported on its own). vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so the connector's counters and step times are readable.

vLLM is imported only here, lazily: it lives in its own virtual environment (``tools/vllm_env.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ANSWER_COLUMNS",
    "PHASES",
    "VllmBenchConfig",
    "VllmMissingError",
    "format_vllm_summary",
    "require_vllm",
    "run_vllm_bench",
]

QA = Path(__file__).resolve().parent / "data" / "qa_invented.json"
# the connector's steps, as RagkvSide.phase_s names them (plan: the scheduler's check of the
# prompt's chunks and entries; the rest: the worker's load before the forward pass)
PHASES = ("plan", "prefix", "entries", "fusion", "extract", "write")
# a row's answer texts: in the JSON, not in the printed table
ANSWER_COLUMNS = ("answer_vllm", "answer_connector", "answer_ragkv_full", "answer_ragkv_fused")


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

    questions: int = 12  # QA questions, one RAG prompt each
    max_tokens: int = 32  # tokens of the end-to-end request (the answers compared)
    docs: int = 10  # QA documents indexed
    fusion_ratio: float | None = None  # share of chunk tokens recomputed (None: ragkv's default)
    model: str | None = None  # an alias, a .gguf file or a model folder (None: ragkv's default model)
    concurrency: int = 1  # > 1: a throughput phase with this many requests at once
    load_async: bool = False  # the connector's load_async
    vllm_dtype: str | None = None  # vLLM's dtype (None: the one ragkv picks here, so both compute alike)

    def __post_init__(self) -> None:
        if self.questions < 1 or self.max_tokens < 1 or self.docs < 1 or self.concurrency < 1:
            raise ValueError("questions, max_tokens, docs and concurrency must each be >= 1")
        if self.fusion_ratio is not None and not 0.0 <= self.fusion_ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be within [0, 1]; got {self.fusion_ratio}")


def _model_folder(model: str | None) -> str:
    """A folder vLLM loads as is: ``model`` if it is one, else the GGUF model (ragkv's default when None)
    converted into ragkv's model cache in the dtype ragkv picks here (``auto``)."""
    from ragkv.model.loading import DEFAULT_MODEL, converted_folder, gguf_file

    name = model or DEFAULT_MODEL
    if gguf_file(name) is None:
        return name
    return str(converted_folder(name, "auto"))


@dataclass(slots=True)
class _Question:
    """One RAG prompt and what ragkv alone did with it."""

    text: str
    golds: list[str]
    ids: list[int]  # the whole prompt, tokenized as a client's prompt reaches vLLM
    ragkv: dict[str, Any] = field(default_factory=dict)


def _ragkv_alone(
    cfg: VllmBenchConfig, folder: str, data_dir: Path, echo: Callable[[str], None]
) -> tuple[list[_Question], dict[str, Any]]:
    """Index the QA documents with ragkv, then answer each question with ragkv alone in this process.

    Per question: full prefill and the default fusion (TTFT, greedy answer), and the connector's own
    ragkv side (``RagkvSide``) fusing the prompt's ids in a plain process, step by step: the
    reference the connector's steps inside vLLM are compared with.
    """
    from ragkv.cache.catalog import Catalog
    from ragkv.cache.store import open_store
    from ragkv.engine import RagKV
    from ragkv.generation import GenerationConfig
    from ragkv.integrations._vllm_config import build_side, engine_config
    from ragkv.model.placement import dtype_name
    from ragkv.retriever.documents import Document

    qa = json.loads(QA.read_text())
    extra = _extra(cfg, data_dir)
    config = engine_config(folder, extra)
    gen = GenerationConfig(max_new_tokens=cfg.max_tokens)
    questions: list[_Question] = []
    with RagKV(config) as engine:
        docs = [Document(f"qa:{d['id']}", d["text"], d["title"]) for d in qa["documents"][: cfg.docs]]
        engine.index(docs, progress=False)
        layout = engine.retriever.layout
        side = build_side(engine.adapter, open_store(config.store_urls()), Catalog(config.catalog_url()), config)
        for q in qa["questions"][: cfg.questions]:
            chunks = engine.retrieve(q["question"])
            text = layout.prefix + "".join(layout.chunk_text(c.text) for c in chunks)
            ids = engine.adapter.encode(text + layout.suffix_text(q["question"]))
            questions.append(_Question(q["question"], list(q["answers"]), ids))

        def fuse_plain(ids: list[int]) -> None:  # the connector's steps, with block size 1 (all chunk tokens)
            plan = side.plan(ids, 0, 1)
            if plan is not None:
                side.fused_kv(ids, plan)

        engine.answer(questions[0].text, generation=gen)  # warm: first calls pay one-time costs
        fuse_plain(questions[0].ids)
        side.phase_s.clear()
        for q in questions:
            full = engine.answer(q.text, mode="full", generation=gen)
            fused = engine.answer(q.text, generation=gen)
            fuse_plain(q.ids)
            q.ragkv = {
                "ttft_full_ms": round(full.stats.ttft_ms, 1),
                "ttft_fused_ms": round(fused.stats.ttft_ms, 1),
                "full": full.text,
                "fused": fused.text,
            }
        plain = {
            "step_ms": {p: round(side.phase_s.get(p, 0.0) * 1000 / len(questions), 1) for p in PHASES},
            "fused_on": dict(side.fused_on),
            "dtype": dtype_name(engine.adapter.dtype),
        }
    echo(f"ragkv alone: {len(questions)} questions, full prefill and fused ({plain['dtype']})")
    return questions, plain


def _extra(cfg: VllmBenchConfig, data_dir: Path) -> dict[str, Any]:
    """The connector's extra config for this run."""
    extra: dict[str, Any] = {"data_dir": str(data_dir), "load_async": cfg.load_async}
    if cfg.fusion_ratio is not None:
        extra["fusion_ratio"] = cfg.fusion_ratio
    return extra


def _agreeing(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_vllm_bench(
    cfg: VllmBenchConfig, echo: Callable[[str], None] = lambda _: None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the benchmark: one row per prompt, and a summary (medians, agreement, per-step times, threads).

    Raises:
        VllmMissingError: vLLM is not installed here.
    """
    require_vllm()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = _model_folder(cfg.model)
    data_dir = Path(tempfile.mkdtemp(prefix="ragkv-bench-vllm-"))
    started = time.perf_counter()
    # ragkv alone first: vLLM's CPU worker rebinds this process's threads once it starts
    questions, plain = _ragkv_alone(cfg, folder, data_dir, echo)
    echo(f"indexed {cfg.docs} documents and ran ragkv alone in {time.perf_counter() - started:.1f} s")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=_extra(cfg, data_dir),
    )
    vllm_dtype = cfg.vllm_dtype or plain["dtype"]
    llm = LLM(
        model=folder,
        dtype=vllm_dtype,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )
    from ragkv.integrations import vllm as connector

    def run(batch: list[list[int]], ragkv: bool, max_tokens: int) -> tuple[float, list[Any]]:
        extra_args = None if ragkv else {"kv_transfer_params": {"ragkv": False}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra_args)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    warm_s, _ = run([questions[0].ids], True, 1)
    echo(f"warm-up (loads ragkv's model copy, first fusion): {warm_s:.2f} s")
    run([questions[0].ids], False, 1)
    (side,) = connector._SIDES.values()
    side.phase_s.clear()
    rows = [_measure(run, i, q, cfg.max_tokens, connector.COUNTS) for i, q in enumerate(questions)]
    summary: dict[str, Any] = {
        "questions": len(rows),
        "warm_up_s": round(warm_s, 2),
        "ragkv_dtype": plain["dtype"],
        "vllm_dtype": vllm_dtype,
        "load_async": cfg.load_async,
        "median_ttft_vllm_ms": statistics.median(r["ttft_vllm_ms"] for r in rows),
        "median_ttft_connector_ms": statistics.median(r["ttft_connector_ms"] for r in rows),
        "median_ttft_ragkv_full_ms": statistics.median(r["ttft_ragkv_full_ms"] for r in rows),
        "median_ttft_ragkv_fused_ms": statistics.median(r["ttft_ragkv_fused_ms"] for r in rows),
        # per request: every prompt ran through the connector twice (TTFT and end-to-end)
        "step_ms": {p: round(side.phase_s.get(p, 0.0) * 1000 / (2 * len(rows)), 1) for p in PHASES},
        "step_ms_plain_process": plain["step_ms"],
        "fused_on": dict(side.fused_on),
        "fused_on_plain_process": plain["fused_on"],
        "same_answer_connector_vs_vllm": sum(r["same_answer"] for r in rows),
        "same_answer_ragkv_fused_vs_full": sum(r["ragkv_same_answer"] for r in rows),
        "right": {k: sum(r[f"right_{k}"] for r in rows) for k in ("vllm", "connector", "ragkv_full", "ragkv_fused")},
    }
    if cfg.concurrency > 1:
        summary["concurrency"] = _throughput(run, [q.ids for q in questions], cfg.concurrency, cfg.max_tokens)
    return rows, summary


def _throughput(
    run: Callable[..., tuple[float, list[Any]]], prompts: list[list[int]], n: int, max_tokens: int
) -> dict[str, Any]:
    """Requests per second with ``n`` requests at once (waves of ``n`` prompts), each side in turn."""
    out: dict[str, Any] = {"requests_at_once": n}
    waves = [prompts[i : i + n] for i in range(0, len(prompts), n)]
    for name, ragkv in (("vllm", False), ("connector", True)):
        seconds = [run(wave, ragkv, max_tokens)[0] for wave in waves]
        out[f"req_per_s_{name}"] = round(len(prompts) / sum(seconds), 3)
        out[f"mean_wave_ms_{name}"] = round(statistics.mean(seconds) * 1000, 1)
    return out


def _measure(run: Callable[..., tuple[float, list[Any]]], i: int, q: _Question, max_tokens: int, counts: Any) -> dict:
    """One prompt: TTFT and end-to-end, with the connector and without, interleaved; and the answers."""
    from ragkv.bench.qa_score import contains_answer

    load_before = counts.load_s
    ttft_c, (out_c,) = run([q.ids], True, 1)
    load_s = counts.load_s - load_before
    ttft_b, _ = run([q.ids], False, 1)
    e2e_c, (full_c,) = run([q.ids], True, max_tokens)
    e2e_b, (full_b,) = run([q.ids], False, max_tokens)
    base, got = list(full_b.outputs[0].token_ids), list(full_c.outputs[0].token_ids)
    text_b, text_c = full_b.outputs[0].text, full_c.outputs[0].text
    return {
        "question": i + 1,
        "prompt_tokens": len(q.ids),
        "served_tokens": int(out_c.num_cached_tokens or 0),
        "ttft_vllm_ms": round(ttft_b * 1000, 1),
        "ttft_connector_ms": round(ttft_c * 1000, 1),
        "ragkv_load_ms": round(load_s * 1000, 1),
        "ttft_ragkv_full_ms": q.ragkv.get("ttft_full_ms", 0.0),
        "ttft_ragkv_fused_ms": q.ragkv.get("ttft_fused_ms", 0.0),
        "e2e_vllm_ms": round(e2e_b * 1000, 1),
        "e2e_connector_ms": round(e2e_c * 1000, 1),
        "agreeing_prefix": f"{_agreeing(base, got)}/{len(base)}",
        "same_answer": base == got,
        "ragkv_same_answer": q.ragkv.get("full", "").strip() == q.ragkv.get("fused", "").strip(),
        "right_vllm": contains_answer(text_b, q.golds),
        "right_connector": contains_answer(text_c, q.golds),
        "right_ragkv_full": contains_answer(q.ragkv.get("full", ""), q.golds),
        "right_ragkv_fused": contains_answer(q.ragkv.get("fused", ""), q.golds),
        # the texts, for the JSON (the table leaves ANSWER_COLUMNS out)
        "answer_vllm": text_b,
        "answer_connector": text_c,
        "answer_ragkv_full": q.ragkv.get("full", ""),
        "answer_ragkv_fused": q.ragkv.get("fused", ""),
    }


def format_vllm_summary(summary: dict[str, Any]) -> list[str]:
    """The lines under ``ragkv bench vllm``'s table."""
    n = summary["questions"]
    right = summary["right"]
    lines = [
        f"median TTFT: vLLM {summary['median_ttft_vllm_ms']:.0f} ms, vLLM + connector "
        f"{summary['median_ttft_connector_ms']:.0f} ms; ragkv alone: full "
        f"{summary['median_ttft_ragkv_full_ms']:.0f} ms, fused {summary['median_ttft_ragkv_fused_ms']:.0f} ms; "
        f"warm-up {summary['warm_up_s']} s",
        f"same answer: connector = vLLM on {summary['same_answer_connector_vs_vllm']}/{n}; "
        f"ragkv fused = ragkv full on {summary['same_answer_ragkv_fused_vs_full']}/{n}",
        f"right answers: vLLM {right['vllm']}, connector {right['connector']}, ragkv full {right['ragkv_full']}, "
        f"ragkv fused {right['ragkv_fused']} of {n}",
    ]
    for label, steps, on in (
        ("inside vLLM", summary["step_ms"], summary["fused_on"]),
        ("plain process", summary["step_ms_plain_process"], summary["fused_on_plain_process"]),
    ):
        text = ", ".join(f"{k} {v:.0f}" for k, v in steps.items())
        where = f"{on.get('torch_threads')} torch threads on CPUs {on.get('cpus')}"
        lines.append(f"connector steps per request, {label} (ms): {text}; {where}")
    load = "background thread" if summary["load_async"] else "inside the step"
    lines.append(f"loading: {load}")
    if "concurrency" in summary:
        c = summary["concurrency"]
        lines.append(
            f"{c['requests_at_once']} requests at once: vLLM {c['req_per_s_vllm']} req/s, "
            f"connector {c['req_per_s_connector']} req/s"
        )
    return lines
