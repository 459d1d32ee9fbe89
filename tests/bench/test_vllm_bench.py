"""``ragkv bench vllm``: its vLLM-free parts (the run itself needs vLLM's own venv and minutes)."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from ragkv.bench import vllm as bench_vllm
from ragkv.bench.vllm import VllmBenchConfig, VllmMissingError, require_vllm
from ragkv.cli import app


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_without_vllm_the_command_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(VllmMissingError, match="tools/vllm_env.sh"):
        require_vllm()
    result = CliRunner().invoke(app, ["bench", "vllm", "--questions", "1"])
    assert result.exit_code == 2
    assert "tools/vllm_env.sh" in _flat(result.output)


def test_bad_settings_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="fusion_ratio"):
        VllmBenchConfig(fusion_ratio=1.5)
    with pytest.raises(ValueError, match=">= 1"):
        VllmBenchConfig(questions=0)


def test_agreeing_prefix_counts_tokens_before_the_first_difference() -> None:
    assert bench_vllm._agreeing([1, 2, 3], [1, 2, 4]) == 2
    assert bench_vllm._agreeing([1, 2], [1, 2, 3]) == 2
    assert bench_vllm._agreeing([5], [6]) == 0


def test_a_row_times_both_sides_of_one_prompt_and_compares_the_answers() -> None:
    class Out:
        def __init__(self, ids: list[int], text: str, cached: int) -> None:
            self.outputs = [type("O", (), {"token_ids": ids, "text": text})()]
            self.num_cached_tokens = cached

    class Counts:
        load_s = 0.0

    calls: list[tuple[bool, int]] = []

    def run(batch: list[list[int]], ragkv: bool, max_tokens: int) -> tuple[float, list[Out]]:
        calls.append((ragkv, max_tokens))
        if ragkv and max_tokens == 1:
            Counts.load_s += 0.25
        out = Out([7, 8, 9], "It is 42.", 128) if ragkv else Out([7, 8, 1], "It is 41.", 0)
        return (0.5 if ragkv else 0.2), [out] * len(batch)

    q = bench_vllm._Question("q?", ["42"], list(range(300)))
    q.ragkv = {"ttft_full_ms": 90.0, "ttft_fused_ms": 30.0, "full": "It is 42.", "fused": " It is 42."}
    row = bench_vllm._measure(run, 0, q, 3, Counts)
    assert calls == [(True, 1), (False, 1), (True, 3), (False, 3)]  # interleaved: same load on both sides
    assert row["served_tokens"] == 128 and row["ragkv_load_ms"] == 250.0
    assert row["ttft_connector_ms"] == 500.0 and row["ttft_vllm_ms"] == 200.0
    assert row["ttft_ragkv_full_ms"] == 90.0 and row["ttft_ragkv_fused_ms"] == 30.0
    assert row["agreeing_prefix"] == "2/3" and row["same_answer"] is False and row["ragkv_same_answer"] is True
    assert row["right_connector"] and not row["right_vllm"] and row["right_ragkv_full"] and row["right_ragkv_fused"]
    assert row["answer_vllm"] == "It is 41." and row["answer_ragkv_fused"] == " It is 42."
    assert set(bench_vllm.ANSWER_COLUMNS) <= set(row)


def test_throughput_sends_waves_of_n_prompts_on_each_side() -> None:
    sizes: list[tuple[bool, int]] = []

    def run(batch: list[list[int]], ragkv: bool, max_tokens: int) -> tuple[float, list[object]]:
        sizes.append((ragkv, len(batch)))
        return (1.0 if ragkv else 2.0), [None] * len(batch)

    got = bench_vllm._throughput(run, [[1]] * 6, 4, 8)
    assert sizes == [(False, 4), (False, 2), (True, 4), (True, 2)]
    assert got == {
        "requests_at_once": 4,
        "req_per_s_vllm": 1.5,
        "mean_wave_ms_vllm": 2000.0,
        "req_per_s_connector": 3.0,
        "mean_wave_ms_connector": 1000.0,
    }


def test_the_summary_lines_name_both_sides_the_steps_and_the_threads() -> None:
    summary = {
        "questions": 12,
        "median_ttft_vllm_ms": 9000.0,
        "median_ttft_connector_ms": 2500.0,
        "median_ttft_ragkv_full_ms": 4000.0,
        "median_ttft_ragkv_fused_ms": 2000.0,
        "warm_up_s": 4.2,
        "same_answer_connector_vs_vllm": 7,
        "same_answer_ragkv_fused_vs_full": 8,
        "right": {"vllm": 5, "connector": 4, "ragkv_full": 5, "ragkv_fused": 5},
        "step_ms": {"plan": 2.0, "fusion": 1900.0},
        "step_ms_plain_process": {"plan": 3.0, "fusion": 1800.0},
        "fused_on": {"torch_threads": 2, "cpus": [0, 1]},
        "fused_on_plain_process": {"torch_threads": 2, "cpus": [0, 1]},
        "load_async": True,
        "concurrency": {"requests_at_once": 4, "req_per_s_vllm": 0.1, "req_per_s_connector": 0.3},
    }
    text = "\n".join(bench_vllm.format_vllm_summary(summary))
    assert "connector = vLLM on 7/12" in text and "ragkv fused = ragkv full on 8/12" in text
    assert "inside vLLM (ms): plan 2, fusion 1900; 2 torch threads on CPUs [0, 1]" in text
    assert "4 requests at once: vLLM 0.1 req/s, connector 0.3 req/s" in text and "background thread" in text
