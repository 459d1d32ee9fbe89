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


def test_a_row_times_both_sides_of_one_prompt() -> None:
    class Out:
        def __init__(self, ids: list[int], cached: int) -> None:
            self.outputs = [type("O", (), {"token_ids": ids})()]
            self.num_cached_tokens = cached

    class Counts:
        load_s = 0.0

    calls: list[tuple[bool, int]] = []

    def run(ids: list[int], ragkv: bool, max_tokens: int) -> tuple[float, Out]:
        calls.append((ragkv, max_tokens))
        if ragkv and max_tokens == 1:
            Counts.load_s += 0.25
        return (0.5 if ragkv else 0.2), Out([7, 8, 9] if ragkv else [7, 8, 1], 128 if ragkv else 0)

    row = bench_vllm._measure(run, 0, list(range(300)), 3, Counts)
    assert calls == [(True, 1), (False, 1), (True, 3), (False, 3)]  # interleaved: same load on both sides
    assert row["served_tokens"] == 128 and row["ragkv_load_ms"] == 250.0
    assert row["ttft_connector_ms"] == 500.0 and row["ttft_vllm_ms"] == 200.0
    assert row["agreeing_prefix"] == "2/3"
