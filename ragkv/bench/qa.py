"""``ragkv bench qa``: answers scored against gold, per fusion method, on an invented multi-document set.

Per question (see :mod:`ragkv.bench.qa_data`): the prompt holds the documents it needs plus one or
two distractors, chunked as ragkv indexes them, with a system prompt asking for a short answer.
:func:`ragkv.bench.fusion.compare_methods` runs full prefill and every method on it (chunk caches
precomputed after the shared prefix, untimed; greedy answers of at most ``max_tokens``), so each
method gets, in the same run as full prefill: its TTFT, its recompute share, KL(full || method) at
the positions of full prefill's answer, and whether its answer equals full prefill's (and their
token F1). This module adds the score against gold: normalized containment of any gold alias
(:func:`ragkv.bench.qa_score.contains_answer`) and token F1.

Rows aggregate over questions: accuracy and F1 are means, KL the mean, TTFT the median and the
TTFT ratio the median of per-question ratios to full prefill.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from ragkv.bench import table
from ragkv.bench.fusion import compare_methods
from ragkv.bench.qa_data import QASet, build_prompt, load_qa_set
from ragkv.bench.qa_score import best_f1, contains_answer
from ragkv.bench.table import Column
from ragkv.fusion import FusionConfig
from ragkv.model import ModelAdapter
from ragkv.selection import StrategyParams, strategy_class

__all__ = [
    "DEFAULT_METHODS",
    "Method",
    "parse_methods",
    "run_qa_bench",
    "merge_results",
    "summarize",
    "format_qa_table",
]

logger = logging.getLogger(__name__)

ANSWER_TOKENS = 24  # gold answers are a few words; longer answers only cost decode time
DEFAULT_METHODS = "full,naive,blend,query_focus,default"


@dataclass(frozen=True, slots=True)
class Method:
    """One row of the bench: a fusion method at a recompute ratio."""

    method: str  # strategy name, or "full" for full prefill
    ratio: float
    default: bool = False  # the engine's default fusion (EngineConfig().fusion)
    params: str = ""  # the method's own knobs, "name=value+name=value" (its Params record's fields)

    @property
    def label(self) -> str:
        name = self.method if self.method in ("full", "naive") else f"{self.method}:{self.ratio:g}"
        name += f":{self.params}" if self.params else ""
        return name + (" (default)" if self.default else "")

    def grid_entry(self) -> tuple[str, float, StrategyParams | None]:
        """``(method, ratio, params record)`` for :func:`ragkv.bench.fusion.compare_methods`."""
        return self.method, self.ratio, method_params(self.method, self.params)


def method_params(method: str, text: str) -> StrategyParams | None:
    """``"number_spans=1+sink_tokens=4"`` -> ``method``'s Params record with those fields (None: none given).

    Values are read as the field's type (bool: 1/0/true/false); an unknown field raises ValueError
    naming the fields there are.
    """
    if not text or method in ("full", "naive"):
        return None
    cls = strategy_class(method).Params
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in text.split("+"):
        key, _, raw = item.partition("=")
        if key not in fields:
            raise ValueError(f"{method} has no parameter {key!r}; its parameters are {sorted(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            values[key] = raw.strip().lower() in ("1", "true", "yes")
        else:
            values[key] = type(default)(raw) if default is not dataclasses.MISSING else raw
    return cls(**values)


def parse_methods(spec: str = DEFAULT_METHODS) -> list[Method]:
    """``"full,naive,blend:0.3,default"`` -> methods; a bare name takes the default ratio.

    ``method:ratio:knob=value+knob=value`` sets the method's own parameters (its Params record),
    e.g. ``query_focus:0.15:number_spans=1+sink_tokens=4``.

    ``default`` is the engine's default fusion (``EngineConfig().fusion``, a plain ``FusionConfig()``);
    a method equal to it is listed once, marked default. Full prefill is always included (first),
    since every other figure is measured against it.

    >>> [m.label for m in parse_methods("naive,query_focus,default")]
    ['full', 'naive', 'query_focus:0.15 (default)']
    """
    base = FusionConfig()  # the engine's default: EngineConfig.fusion's default_factory
    out: list[Method] = [Method("full", 1.0)]
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, rest = part.partition(":")
        ratio, _, params = rest.partition(":")
        if name == "default":
            name, ratio = base.method, str(base.ratio)
        r = {"full": 1.0, "naive": 0.0}.get(name, float(ratio) if ratio else base.ratio)
        if name not in ("full", "naive"):
            # unknown method, bad ratio or parameter: fail before loading anything
            FusionConfig(method=name, ratio=r, params=method_params(name, params))
        m = Method(name, r, default=(name, r, params) == (base.method, base.ratio, ""), params=params)
        if all((o.method, o.ratio, o.params) != (m.method, m.ratio, m.params) for o in out):
            out.append(m)
    return out


def run_qa_bench(
    adapter: ModelAdapter,
    qa: QASet | None = None,
    methods: Sequence[Method] | None = None,
    *,
    limit: int | None = None,
    only: Sequence[str] = (),
    max_tokens: int = ANSWER_TOKENS,
    seed: int = 0,
    on_question: Callable[[dict[str, Any]], None] | None = None,
    decode_weights: str = "model",
) -> dict[str, Any]:
    """Run the QA bench: ``{"meta", "rows", "questions"}``.

    ``decode_weights``: the weights the answers are decoded with (``"model"``, or an ``"int8"``/
    ``"int4"`` decode copy, as ``EngineConfig.decode_weights``); prefill and fusion use the model's.

    ``rows``: one per method (keys of :data:`TABLE`); ``questions``: per question, its documents and
    each method's answer and scores; ``meta``: model, dtype, set, question count, seed, max tokens.
    ``only``: question ids to run (all when empty), then ``limit`` keeps the first ones. ``on_question``
    gets each question's record as soon as it is done (a long run's progress).
    """
    qa = qa or load_qa_set()
    methods = list(methods or parse_methods())
    unknown = set(only) - {q.id for q in qa.questions}
    if unknown:
        raise ValueError(
            f"no question {sorted(unknown)} in the set; its ids run {qa.questions[0].id}..{qa.questions[-1].id}"
        )
    questions = [q for q in qa.questions if not only or q.id in only][:limit]

    def count(text: str) -> int:
        return len(adapter.encode(text))

    prompts = [build_prompt(qa, q, count, seed=seed) for q in questions]
    grid = [m.grid_entry() for m in methods]
    weights = decode_weights if decode_weights != "model" else None
    compare_methods(adapter, {"chunks": ["warm up the kernels."], "question": "ok?"}, [("blend", 0.5)])
    per_question = []
    for q, p in zip(tqdm(questions, desc="qa bench", unit="question"), prompts, strict=True):
        results = compare_methods(adapter, p, grid, answer_tokens=max_tokens, decode_weights=weights)  # type: ignore[arg-type]
        answers = {}
        for m, r in zip(methods, results, strict=True):
            text = adapter.decode(r["answer"]).strip()
            answers[m.label] = dict(
                answer=text,
                correct=contains_answer(text, q.answers),
                f1_gold=best_f1(text, q.answers),
                kl=r["kl"],
                same_as_full=r["exact_match"],
                f1_full=r["f1"],
                recompute=r["recompute_ratio"],
                ttft_ms=r["ttft_ms"],
                ttft_ratio=r["ttft_ratio"],
            )
        record = dict(id=q.id, question=q.question, gold=list(q.answers), docs=p["docs"], needs=len(q.docs))
        per_question.append({**record, "methods": answers})
        if on_question is not None:
            on_question(per_question[-1])
    meta = dict(
        model=adapter.name,
        dtype=str(adapter.dtype).removeprefix("torch."),
        qa_set=qa.name,
        questions=len(questions),
        seed=seed,
        max_tokens=max_tokens,
        decode_weights=decode_weights,
        default_fusion=next((m.label for m in methods if m.default), FusionConfig().method),
    )
    return {"meta": meta, "rows": summarize(per_question, meta), "questions": per_question}


def merge_results(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One result from runs over disjoint questions (``--only``) of the same model, dtype and methods.

    Rows are summarized again over every question (a median of medians would not be the median);
    raises ValueError when the runs differ in model, dtype, set, seed, answer length or methods.
    """
    if not results:
        raise ValueError("nothing to merge; pass the results of one or more runs")
    keys = ("model", "dtype", "qa_set", "seed", "max_tokens", "default_fusion")
    first = results[0]["meta"]
    for r in results[1:]:
        differ = [k for k in keys if r["meta"][k] != first[k]]
        if r["meta"].get("decode_weights", "model") != first.get("decode_weights", "model"):
            differ.append("decode_weights")
        if differ or list(r["questions"][0]["methods"]) != list(results[0]["questions"][0]["methods"]):
            raise ValueError(f"runs differ in {differ or ['methods']}; merge only runs of one configuration")
    questions = sorted((q for r in results for q in r["questions"]), key=lambda q: q["id"])
    if len({q["id"] for q in questions}) != len(questions):
        raise ValueError("the runs share questions; merge runs over disjoint --only sets")
    meta = {**first, "questions": len(questions)}
    return {"meta": meta, "rows": summarize(questions, meta), "questions": questions}


def summarize(per_question: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per method (in the order of the first question's methods) from per-question records."""
    labels = list(per_question[0]["methods"]) if per_question else []
    return [_aggregate(label, [pq["methods"][label] for pq in per_question], per_question, meta) for label in labels]


def _aggregate(
    label: str, got: Sequence[Mapping[str, Any]], per_question: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    n = len(got)
    two = [g for g, pq in zip(got, per_question, strict=True) if pq["needs"] > 1]

    def mean(key: str, rows: Sequence[Mapping[str, Any]] = got) -> float:
        return sum(float(r[key]) for r in rows) / len(rows) if rows else 0.0

    return dict(
        method=label,
        dtype=meta["dtype"],
        correct=sum(bool(g["correct"]) for g in got),
        right=f"{sum(bool(g['correct']) for g in got)}/{n}",
        questions=n,
        accuracy=mean("correct"),
        accuracy_two_docs=mean("correct", two),
        f1_gold=mean("f1_gold"),
        kl=mean("kl"),
        same_as_full=mean("same_as_full"),
        f1_full=mean("f1_full"),
        recompute=mean("recompute"),
        ttft_ms=statistics.median(g["ttft_ms"] for g in got) if got else 0.0,
        ttft_ratio=statistics.median(g["ttft_ratio"] for g in got) if got else 0.0,
    )


TABLE = (
    Column("method"),
    Column("dtype"),
    Column("right"),
    Column("accuracy", "acc", "{:.3f}"),
    Column("accuracy_two_docs", "acc 2-doc", "{:.3f}"),
    Column("f1_gold", "F1 gold", "{:.3f}"),
    Column("kl", "KL vs full", "{:.4f}"),
    Column("same_as_full", "same as full", "{:.3f}"),
    Column("f1_full", "F1 vs full", "{:.3f}"),
    Column("recompute", "recompute", "{:.3f}"),
    Column("ttft_ms", "TTFT ms (median)", "{:.0f}"),
    Column("ttft_ratio", "TTFT / full", "{:.3f}"),
)


def format_qa_table(result: Mapping[str, Any]) -> str:
    """A caption line (model, dtype, set, questions) and the rows as a Markdown table (:data:`TABLE`)."""
    m = result["meta"]
    caption = (
        f"QA bench: model {m['model']}, dtype {m['dtype']}, set {m['qa_set']} ({m['questions']} questions), "
        f"greedy, max {m['max_tokens']} tokens, seed {m['seed']}; default fusion {m['default_fusion']}; "
        f"decode weights {m.get('decode_weights', 'model')}"
    )
    return caption + "\n\n" + table.format_table(result["rows"], TABLE)
