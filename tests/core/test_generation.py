"""Generation: token picking against the written-out distribution, the decode loop against a
cache-free recompute, and text streaming against the decoded whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragkv.generation import GenerationConfig, _pick, decode_loop, generate_ids, stream_text
from tests.core.test_model import _ids


def _slow_weights(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """Sampling weights written out: temperature, keep the top k, keep the smallest nucleus >= top_p."""
    probs = torch.softmax(logits / cfg.temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    keep = set(order[: cfg.top_k]) if cfg.top_k else set(order)
    probs = torch.tensor([float(p) if i in keep else 0.0 for i, p in enumerate(probs)])
    probs = probs / probs.sum()
    nucleus, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -float(probs[i])):
        if mass >= cfg.top_p:
            break
        nucleus.add(i)
        mass += float(probs[i])
    return torch.tensor([float(p) if i in nucleus else 0.0 for i, p in enumerate(probs)])


@pytest.mark.parametrize(
    "cfg",
    [
        GenerationConfig(temperature=0.7),
        GenerationConfig(temperature=1.3, top_k=5),
        GenerationConfig(temperature=1.0, top_p=0.6),
        GenerationConfig(temperature=0.9, top_k=8, top_p=0.8),
    ],
    ids=["temperature", "top_k", "top_p", "both"],
)
def test_sampling_draws_from_the_written_out_distribution(cfg):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 3
    weights = _slow_weights(logits, cfg)
    for seed in range(20):
        got = _pick(logits, cfg, torch.Generator().manual_seed(seed))
        want = int(torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(seed)))
        assert got == want and weights[got] > 0


def test_greedy_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert _pick(logits, GenerationConfig(), None) == int(logits.argmax())


def test_config_refuses_bad_settings():
    for bad in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GenerationConfig(**bad)


def _slow_greedy(adapter, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Greedy decoding with no cache: the whole sequence is run again for every token."""
    out: list[int] = []
    for _ in range(n):
        tok = int(adapter.forward(prompt + out, adapter.build_cache([]), 0)[-1].argmax())
        if tok in eos:
            break
        out.append(tok)
    return out


def test_decode_loop_equals_recomputing_the_whole_sequence(llama_adapter):
    a = llama_adapter
    context, suffix = _ids(30, 1), _ids(6, 2)
    kv = a.prefill_kv(context)
    answer = generate_ids(a, [kv], suffix, 8)
    assert answer == _slow_greedy(a, context + suffix, 8, a.eos_token_ids)
    cache = a.build_cache([kv])
    first = a.forward(suffix, cache, len(context))[-1]
    assert list(decode_loop(a, cache, first, len(context) + len(suffix), GenerationConfig(max_new_tokens=8))) == answer


def test_decode_loop_stops_before_an_end_token(llama_adapter):
    a = llama_adapter
    context, suffix = _ids(30, 1), _ids(6, 2)
    full = generate_ids(a, [a.prefill_kv(context)], suffix, 8)
    stop = full[3]
    # the same model with one more end token (a Decoder is any object with these three members)
    model = SimpleNamespace(eos_token_ids={stop}, build_cache=a.build_cache, forward=a.forward)
    assert generate_ids(model, [a.prefill_kv(context)], suffix, 8) == full[: full.index(stop)]


def test_seeded_sampling_is_repeatable(llama_adapter):
    a = llama_adapter
    kv, suffix = a.prefill_kv(_ids(20, 3)), _ids(4, 4)
    cfg = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=7)

    def run() -> list[int]:
        cache = a.build_cache([kv])
        return list(decode_loop(a, cache, a.forward(suffix, cache, 20)[-1], 24, cfg))

    assert run() == run()


class _Bytes:
    """Token ids are UTF-8 bytes (what the tiny test tokenizer does), decoded with replacement."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    ("text", "stop", "want"),
    [
        ("plain answer", (), "plain answer"),
        ("naïve – café ☕ done", (), "naïve – café ☕ done"),
        ("Hello STOP world", ("STOP",), "Hello "),
        ("aSTb", ("ST", "zz"), "a"),
        ("no stop here", ("STOP",), "no stop here"),
        ("ends with ST", ("STOP",), "ends with ST"),
    ],
)
def test_streamed_text_is_the_whole_text_cut_at_the_first_stop(text, stop, want):
    deltas = list(stream_text(_Bytes(), iter(text.encode()), stop))
    assert "".join(d for d, _ in deltas) == want
    assert all("\ufffd" not in d for d, _ in deltas)  # never half a character
    emitted = ""
    for d, _ in deltas:
        emitted += d
        assert not any(s and s in emitted for s in stop)  # a stop string is never shown


def test_ignore_eos_decodes_exactly_max_new_tokens(llama_adapter):
    a = llama_adapter
    context, suffix = _ids(30, 1), _ids(6, 2)
    full = generate_ids(a, [a.prefill_kv(context)], suffix, 8)
    model = SimpleNamespace(eos_token_ids={full[2]}, build_cache=a.build_cache, forward=a.forward)
    cache = a.build_cache([a.prefill_kv(context)])
    first = a.forward(suffix, cache, 30, logits="last")[-1]
    cfg = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    assert list(decode_loop(model, cache, first, 36, cfg)) == full


@pytest.mark.parametrize("temperature", [4.5857840228634444e-92, 1e-46, 1e-45, 1e-37, 1e-6])
def test_a_tiny_temperature_samples_the_top_token_instead_of_failing_on_nan(temperature):
    """Regression: logits / 1e-37 overflowed to inf, softmax gave NaN and the pick raised; below
    float32's smallest number the temperature itself rounded to 0 (found by the server's fuzz test)."""
    from ragkv.generation import pick_token

    logits = torch.tensor([3.0, 40.0, 39.9, -5.0])
    gen = torch.Generator().manual_seed(0)
    cfg = GenerationConfig(temperature=temperature, seed=0)
    assert {pick_token(logits, cfg, gen) for _ in range(20)} == {1}


def test_a_temperature_that_is_not_a_number_is_refused():
    with pytest.raises(ValueError, match="temperature must be a number"):
        GenerationConfig(temperature=float("nan"))
