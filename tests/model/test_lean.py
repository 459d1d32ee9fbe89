"""ragkv.model.lean: decode steps without transformers' layer machinery give the same logits, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ragkv.model import ModelAdapter
from ragkv.model.batch import DecodeBatch
from ragkv.model.lean import lean_plan
from tests.conftest import make_model


def _steps(a: ModelAdapter, weights: str, rows: int) -> torch.Tensor:
    """Logits of 4 decode steps of ``rows`` rows (rows of different lengths: a masked batch)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 200, (20,), generator=g).tolist()
    batch = DecodeBatch(a, weights=weights)  # type: ignore[arg-type]
    for r in range(rows):
        cache = a.build_cache([])
        a.forward(prompt[: 20 - 3 * r], cache, 0, logits="none")
        batch.add(f"r{r}", cache, 20 - 3 * r, reserve=8)
    return torch.stack([batch.step([5 + t + r for r in range(rows)]) for t in range(4)])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("weights", ["model", "int8"])
def test_lean_steps_equal_the_transformers_layers_bit_for_bit(tiny_tokenizer, monkeypatch, family, weights):
    a = ModelAdapter(make_model(family, len(tiny_tokenizer)), tiny_tokenizer)
    assert lean_plan(a.model_for(weights)) is not None  # type: ignore[arg-type]
    for rows in (1, 3):
        monkeypatch.setenv("RAGKV_LEAN_DECODE", "0")
        slow = _steps(a, weights, rows)
        monkeypatch.setenv("RAGKV_LEAN_DECODE", "1")
        fast = _steps(a, weights, rows)
        assert torch.equal(fast, slow), (family, weights, rows, float((fast - slow).abs().max()))


def test_layers_of_unknown_arithmetic_keep_the_transformers_path(tiny_tokenizer, monkeypatch):
    gelu = make_model("llama", len(tiny_tokenizer), hidden_act="gelu")
    assert lean_plan(gelu) is None
    window = make_model("mistral", len(tiny_tokenizer), sliding_window=8)
    assert lean_plan(window) is None
    plain = make_model("qwen2", len(tiny_tokenizer))
    monkeypatch.setenv("RAGKV_LEAN_DECODE", "0")
    assert lean_plan(plain) is None
