"""ragkv.model.lean: decode steps without transformers' layer machinery give the same logits, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ragkv.model import ModelAdapter
from ragkv.model.batch import DecodeBatch
from ragkv.model.lean import layer_parts, lean_plan
from tests.conftest import make_model

# the bit-for-bit tests also run on a GPU (tools/gpu_check.sh runs this file's CUDA cases with -m gpu)
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])]


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_kv_alone_is_what_the_whole_layer_writes_bit_for_bit(tiny_tokenizer, family, dtype, device):
    a = ModelAdapter(make_model(family, len(tiny_tokenizer)).to(device=device, dtype=dtype), tiny_tokenizer)
    assert a.writes_layer_kv
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 7, a.model.config.hidden_size, generator=g).to(device=device, dtype=dtype)
    pos = torch.tensor([3, 4, 9, 10, 11, 20, 30])
    rope = a.position_embeddings(pos, hidden)
    shape = (a.spec.num_layers, a.model.config.num_key_value_heads, 40, a.model.config.head_dim)
    whole, alone = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(2)
    ]
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


def _prefill_cache(a: ModelAdapter, ids: list[int], past: int) -> list[torch.Tensor]:
    """Every layer's keys and values after ``forward(logits="none")`` of ``ids`` over ``past`` tokens."""
    cache = a.build_cache([])
    if past:
        a.forward(list(range(1, past + 1)), cache, 0, logits="none")
    a.forward(ids, cache, past, logits="none")
    return [t for layer in range(a.spec.num_layers) for t in (cache.layers[layer].keys, cache.layers[layer].values)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_for_its_cache_writes_the_last_layer_as_the_whole_layer_does(
    tiny_tokenizer, monkeypatch, family, dtype, device
):
    """forward(logits="none") cuts its last layer to the K/V it writes: every layer's cache bit for bit
    what the whole stack writes (after a past of 0 and of 11 tokens)."""
    from ragkv.model import adapter as adapter_mod
    from ragkv.model import lean

    a = ModelAdapter(make_model(family, len(tiny_tokenizer)).to(device=device, dtype=dtype), tiny_tokenizer)
    ids = torch.randint(0, 200, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    cut: list[bool] = []
    real = lean.kv_only_last_layer
    last = a.model.model.layers[-1]
    whole_runs = [0]
    counter = last.register_forward_hook(lambda *_: whole_runs.__setitem__(0, whole_runs[0] + 1))

    def spy(*args):
        cut.append(real(*args))

    for past in (0, 11):
        whole_runs[0] = 0
        monkeypatch.setattr(adapter_mod, "kv_only_last_layer", spy)
        fast = _prefill_cache(a, ids, past)
        assert whole_runs[0] == 0 and last in lean._HOOKED  # the last layer never ran whole
        monkeypatch.setattr(adapter_mod, "kv_only_last_layer", lambda model, run, cache: run())
        slow = _prefill_cache(a, ids, past)
        assert whole_runs[0] == (2 if past else 1)
        assert len(fast) == len(slow) == 2 * a.spec.num_layers and fast[-1].shape[2] == past + len(ids)
        for f, s in zip(fast, slow, strict=True):
            assert torch.equal(f, s), (family, dtype, past, float((f.float() - s.float()).abs().max()))
    counter.remove()
    assert cut and all(cut)


def test_the_cut_acts_only_on_the_thread_that_asked(tiny_tokenizer):
    """A pass of another thread through the same model, while one thread's cut is set, runs whole."""
    import threading

    from ragkv.model import lean

    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    ids = list(range(3, 20))
    want = a.forward(ids, a.build_cache([]), 0, logits="last")
    a.prefill_kv(ids)  # a cut pass: the last layer now has the hook
    assert a.model.model.layers[-1] in lean._HOOKED
    got: list[torch.Tensor] = []
    lean._CUT.layer = a.model.model.layers[-1]  # this thread's pass would stop at the last layer
    try:
        worker = threading.Thread(target=lambda: got.append(a.forward(ids, a.build_cache([]), 0, logits="last")))
        worker.start()
        worker.join()
    finally:
        lean._CUT.layer = None
    assert len(got) == 1 and torch.equal(got[0], want)
    assert torch.equal(a.forward(ids, a.build_cache([]), 0, logits="last"), want)  # and, unset, here too


def test_layers_of_unknown_arithmetic_run_a_cache_pass_whole(tiny_tokenizer):
    from ragkv.model import lean
    from ragkv.model.caches import cache_kwarg

    gelu = ModelAdapter(make_model("llama", len(tiny_tokenizer), hidden_act="gelu"), tiny_tokenizer)
    cache = gelu.build_cache([])
    inner = gelu.model.model

    def stack() -> None:
        inner(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(type(inner)): cache})

    assert not lean.kv_only_last_layer(gelu.model, stack, cache)
    assert cache.get_seq_length() == 3


def test_a_call_the_hook_cannot_read_runs_the_layer_whole(tiny_tokenizer):
    """No position embeddings given to the layer (another transformers' call): no cut, no error."""
    from ragkv.model import lean

    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    last = a.model.model.layers[-1]
    lean._CUT.layer = last
    try:
        assert lean._stop_here(last, (torch.zeros(1, 2, 64),), {}) is None  # not raised
        assert lean._CUT.layer is None  # the rest of the pass runs whole
        lean._CUT.layer = last
        assert lean._stop_here(last, (torch.zeros(1, 2, 64),)) is None  # called without kwargs
    finally:
        lean._CUT.layer = None
