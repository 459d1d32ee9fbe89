"""``ragkv bench stream``: TTFT and KL of fixed levels, text and the load planner over a limited link.

A real redis-server and this process share a private network namespace whose loopback is slowed
by a ``tbf`` qdisc (``ragkv.bench.netns``); the store is that Redis alone (no memory tier, so
every answer reads over the link). One prompt's chunks are stored at every level. For each
scenario (10 Mbit/s, 100 Mbit/s, 1 Gbit/s, unlimited, and 1 Gbit/s dropping to 20 Mbit/s after
the first chunk) every policy prefills the prompt: each fixed level, text (full prefill) and the
planner without and with a deadline, and the planner from a cold link estimate (``adaptive-cold``:
the tier's read estimate forgotten before each run, so its first chunk is a probe). TTFT is
question in to first-token logits; KL is KL(full || policy) of the next-token distributions over
the question's positions.

Deadlines (``--slo-ms`` sets one for every scenario): on a steady link, 1.1x the full-prefill TTFT
measured in the same run (text alone just meets it); under the drop, ``DROP_DEADLINE_FACTOR`` x
the best fixed level's TTFT on the unlimited link of the same run (an SLO of "twice what this
prompt takes on a healthy link"; every level meets it at 1 Gbit/s).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ragkv.answering import PromptParts
from ragkv.bench import netns, table
from ragkv.bench.table import Column
from ragkv.model import ModelAdapter
from ragkv.types import CodecSpec, GenerationStats, LogitsWanted

logger = logging.getLogger(__name__)

__all__ = ["SCENARIOS", "format_table", "plot_rows", "run_stream_bench"]

# (name, Mbit/s at the start (None: unlimited), Mbit/s after the first chunk arrives (None: no change))
SCENARIOS: list[tuple[str, float | None, float | None]] = [
    ("10mbit", 10, None),
    ("100mbit", 100, None),
    ("1gbit", 1000, None),
    ("unlimited", None, None),
    ("drop-1gbit-20mbit", 1000, 20),
]
DROP_DEADLINE_FACTOR = 2.0  # the drop scenario's deadline, x the best fixed TTFT on the unlimited link
COLUMNS = (
    Column("scenario"),
    Column("policy"),
    Column("ttft_ms", "TTFT ms", "{:,.0f}"),
    Column("kl", "KL vs full", "{:.4f}"),
    Column("mbytes", "MB read", "{:.2f}"),
    Column("choices", "choices"),
    Column("met", "deadline met"),
)


def run_stream_bench(
    adapter: ModelAdapter,
    levels: Sequence[int],
    *,
    chunks: int = 4,
    repeats: int = 3,
    slo_ms: float | None = None,
    scenarios: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Every (scenario, policy) row; call inside the namespace (see :func:`netns.reexec_inside`).

    ``scenarios``: names from :data:`SCENARIOS` to run (None: all); the drop scenario brings the
    unlimited one, whose TTFTs set its deadline.
    """
    known = [name for name, *_ in SCENARIOS]
    wanted = set(known if scenarios is None else scenarios)
    if unknown := wanted - set(known):
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; choose from {known}")
    if any(after is not None and name in wanted for name, _, after in SCENARIOS):
        wanted.add("unlimited")
    chosen = [sc for sc in SCENARIOS if sc[0] in wanted]
    from ragkv.bench.fusion import builtin_prompts

    prompt = builtin_prompts(adapter, n=1, max_tokens=2000)[0]
    with tempfile.TemporaryDirectory() as tmp:
        redis = netns.start_redis(Path(tmp))
        try:
            engine = _engine(adapter, Path(tmp), [CodecSpec("cachegen", lv) for lv in levels])
            with engine:
                texts = prompt["chunks"][:chunks]
                return _all_scenarios(engine, texts, prompt["question"], levels, repeats, slo_ms, chosen)
        finally:
            redis.kill()
            redis.wait()


def _engine(adapter: ModelAdapter, tmp: Path, specs: list[CodecSpec]) -> Any:
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.retriever.embedder import HashingEmbedder
    from ragkv.retriever.kv_retriever import RetrieverConfig

    cfg = EngineConfig(
        data_dir=tmp,
        store=("redis://127.0.0.1:6399/0?timeout=120",),
        retriever=RetrieverConfig(codec=specs[0], index_codecs=tuple(specs[1:])),
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _all_scenarios(
    engine: Any,
    texts: list[str],
    question: str,
    levels: Sequence[int],
    repeats: int,
    slo_ms: float | None,
    scenarios: Sequence[tuple[str, float | None, float | None]],
) -> list[dict[str, Any]]:
    from ragkv.planner.config import LoadConfig

    rt = engine.retriever
    middle = [(list(rt.chunk_token_ids(t)), True) for t in texts]
    for seg, _ in middle:
        rt.ensure(seg)  # stored at every level, sizes in the catalog
    suffix = engine.adapter.encode(rt.layout.suffix_text(question))
    prompt = (rt.prefix_ids, middle, suffix)
    netns.set_rate(None)
    ref, text_ms = _full(engine, prompt), []
    for _ in range(2):  # warm-up: allocator, the planner's speed estimates
        _prefill(engine, prompt, LoadConfig(), ref)
        text_ms.append(_full_ttft(engine, prompt))
    policies: list[tuple[str, Any]] = [(f"level:{lv}", LoadConfig(fixed=CodecSpec("cachegen", lv))) for lv in levels]
    policies += [("text", None), ("adaptive", LoadConfig()), ("adaptive-cold", LoadConfig())]
    steady = slo_ms if slo_ms is not None else round(1.1 * min(text_ms))  # text alone (just) meets it
    rows: list[dict[str, Any]] = []
    for name, start, after in scenarios:
        deadline = steady if after is None or slo_ms is not None else _drop_deadline(rows)
        for policy, load in [*policies, ("adaptive+deadline", LoadConfig(slo_ms=deadline))]:
            runs = []
            for _ in range(repeats):
                netns.set_rate(start)
                if policy == "adaptive-cold":  # a cold start: nothing known of the link
                    for link in engine.store.read_estimates().values():
                        link.reset()
                    engine.load_estimates.last_tier = None
                hook = _drop_after_first_read(engine, after) if after is not None else None
                try:
                    runs.append(_prefill(engine, prompt, load, ref))
                finally:
                    if hook is not None:
                        hook()
            row = dict(min(runs, key=lambda r: r["ttft_ms"]))  # the best of the repeats (noise is one-sided)
            row.update(scenario=name, bandwidth_mbit=start, policy=policy, deadline_ms=deadline)
            row["met"] = row["ttft_ms"] <= deadline
            rows.append(row)
            logger.info("%s %s: %.0f ms", name, policy, row["ttft_ms"])
    netns.set_rate(None)
    return rows


def _drop_deadline(rows: Sequence[dict[str, Any]]) -> float:
    """``DROP_DEADLINE_FACTOR`` x the best fixed level's TTFT on the unlimited link (run before)."""
    fixed = [r["ttft_ms"] for r in rows if r["scenario"] == "unlimited" and r["policy"].startswith("level:")]
    return round(DROP_DEADLINE_FACTOR * min(fixed))


def _drop_after_first_read(engine: Any, mbit: float) -> Any:
    """Change the link's rate once the first chunk has been read; returns the undo."""
    store = engine.store
    fetch = store.fetch

    def fetch_then_drop(key: str) -> Any:
        got = fetch(key)
        if store.fetch is fetch_then_drop:
            store.fetch = fetch  # once
            netns.change_rate(mbit)
        return got

    store.fetch = fetch_then_drop
    return lambda: vars(store).pop("fetch", None)  # the class's method again


def _full(engine: Any, prompt: Any, logits: LogitsWanted = "all") -> torch.Tensor:
    """Full prefill's logits at the suffix's positions (``"last"``: the last one only, as an engine
    computes them before its first token; on Qwen 0.5B the LM head over every prompt token made a
    full prefill about 1.6x slower, docs/benchmarks.md "Answers against gold")."""
    prefix, middle, suffix = prompt
    ids = prefix + [t for seg, _ in middle for t in seg] + suffix
    with torch.inference_mode():
        return engine.adapter.forward(ids, engine.adapter.build_cache([]), 0, logits=logits)[-len(suffix) :]


def _full_ttft(engine: Any, prompt: Any) -> float:
    """Full prefill's TTFT; the engine's prefill speed estimate takes it, as its own full prefills do."""
    started = time.perf_counter()
    _full(engine, prompt, "last")[-1].argmax()
    seconds = time.perf_counter() - started
    prefix, middle, suffix = prompt
    n = len(prefix) + sum(len(seg) for seg, _ in middle) + len(suffix)
    engine.load_estimates.recompute.observe(n, seconds)
    return seconds * 1000


def _prefill(engine: Any, prompt: Any, load: Any, ref: torch.Tensor) -> dict[str, Any]:
    """One policy's prefill (None: text, i.e. full prefill), timed to the first token's logits."""
    prefix, middle, suffix = prompt
    if load is None:
        ttft = _full_ttft(engine, prompt)
        return {"ttft_ms": ttft, "kl": 0.0, "mbytes": 0.0, "choices": ["text"] * len(middle)}
    engine.config = replace(engine.config, load=load)
    stats = GenerationStats()
    started = time.perf_counter()
    with torch.inference_mode():
        parts = PromptParts(prefix, middle, suffix)
        _, logits = engine.answers.fused_prefill(parts, engine.config.fusion, stats, started)
        logits[-1].argmax()
    ttft = (time.perf_counter() - started) * 1000
    report = stats.extra.get("load", {})
    return {
        "ttft_ms": ttft,
        "kl": _kl(ref, logits),
        "mbytes": stats.bytes_loaded / 1e6,
        "choices": report.get("choices", []),
        "bandwidth_estimate_mbit": report.get("bandwidth_mbit_last"),
    }


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(ref || got) of the next-token distributions over the question's positions."""
    p = torch.log_softmax(ref.float(), -1)
    q = torch.log_softmax(got.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    shown = [{**r, "choices": " ".join(_short(c) for c in r["choices"])} for r in rows]
    return table.format_table(shown, COLUMNS)


def _short(choice: str) -> str:
    return choice.split(":")[-1] if choice.startswith("cachegen:") else choice[0]


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """Per scenario: the best fixed choice, and the adaptive TTFT against it (the issue's targets)."""
    lines = []
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        fixed = [r for r in mine if r["policy"].startswith("level:") or r["policy"] == "text"]
        best = min(fixed, key=lambda r: r["ttft_ms"])
        for r in mine:
            if r["policy"].startswith("adaptive") and best["ttft_ms"] > 0:
                lines.append(
                    f"{name}: {r['policy']} {r['ttft_ms']:.0f} ms = {r['ttft_ms'] / best['ttft_ms']:.2f}x the best "
                    f"fixed ({best['policy']}, {best['ttft_ms']:.0f} ms); KL {r['kl']:.4f} vs {best['kl']:.4f}; "
                    f"met {r['met']} (fixed meeting it: {sum(f['met'] for f in fixed)}/{len(fixed)})"
                )
    return "\n".join(lines)


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """TTFT vs bandwidth, one line per policy (the constant-rate scenarios)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {r["scenario"] for r in rows}
    steady = [n for n, _, after in SCENARIOS if after is None and n in ran]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        ys = [next(r["ttft_ms"] for r in rows if r["policy"] == policy and r["scenario"] == n) for n in steady]
        ax.plot(steady, ys, marker="o", label=policy)
    ax.set_xlabel("link bandwidth (tbf on loopback)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
