"""experiments/gpu_llama8b.py: the same code on a tiny config on the CPU, and its refusal without CUDA.

No timing is asserted (speed goes to docs/benchmarks.md): only that every measurement runs and
lands in the table.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_llama8b.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_llama8b", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_fills_every_column(bench, capsys) -> None:
    rows = bench.main(["--tiny", "--contexts", "200,300", "--chunk", "32", "--repeats", "1"])
    assert [r["chunks"] for r in rows] == [4, 7] and [r["tokens"] for r in rows] == [176, 272]
    for row in rows:
        assert {c.key for c in bench.COLUMNS} <= row.keys()
        assert all(math.isfinite(v) for v in row.values())
        assert row["full_ms"] > 0 and row["ttft_ms"] > 0 and row["decode_gb_s"] > 0 and row["kl"] >= 0
    out = capsys.readouterr().out
    assert "| prompt tokens |" in out and "tiny, random weights" in out


def test_it_refuses_cleanly_without_cuda(bench, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device.*--tiny"):
        bench.main([])


def test_the_full_size_shape_is_llama_3_1_8b(bench) -> None:
    from transformers import LlamaConfig

    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**bench.LLAMA_3_1_8B))
    params = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B: 8.03B parameters
