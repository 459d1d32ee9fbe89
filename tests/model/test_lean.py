"""ragkv.model.lean: decode steps without transformers' layer machinery give the same logits, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ragkv.model import ModelAdapter
from ragkv.model.batch import DecodeBatch
from ragkv.model.lean import layer_parts, lean_plan
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
    assert layer_parts(plain) is not None  # the switch is decode's: fusion still writes K/V alone


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_kv_alone_is_what_the_whole_layer_writes_bit_for_bit(tiny_tokenizer, family, dtype):
    a = ModelAdapter(make_model(family, len(tiny_tokenizer)).to(dtype), tiny_tokenizer)
    assert a.writes_layer_kv
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 7, a.model.config.hidden_size, generator=g).to(dtype)
    pos = torch.tensor([3, 4, 9, 10, 11, 20, 30])
    rope = a.position_embeddings(pos, hidden)
    shape = (a.spec.num_layers, a.model.config.num_key_value_heads, 40, a.model.config.head_dim)
    whole, alone = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(2)]
    with torch.no_grad():
        for layer in range(a.spec.num_layers):
            a.run_layer(layer, hidden, pos, a.scatter_cache(*whole), rope, a.causal_mask(pos, 40, dtype))
            a.write_layer_kv(layer, hidden, pos, a.scatter_cache(*alone), rope)
    assert whole[0].abs().sum() > 0
    assert torch.equal(alone[0], whole[0]) and torch.equal(alone[1], whole[1])


def test_write_layer_kv_refuses_layers_of_unknown_arithmetic(tiny_tokenizer):
    a = ModelAdapter(make_model("llama", len(tiny_tokenizer), hidden_act="gelu"), tiny_tokenizer)
    assert not a.writes_layer_kv
    keys = torch.zeros(a.spec.num_layers, 2, 8, 16)
    with pytest.raises(RuntimeError, match="run_layer runs them whole"):
        a.write_layer_kv(0, torch.zeros(1, 1, 64), torch.tensor([0]), a.scatter_cache(keys, keys.clone()), (None, None))  # type: ignore[arg-type]
