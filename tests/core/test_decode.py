"""The static decoder (ragkv.model.decode) against the plain transformers forward of the same weights."""

from __future__ import annotations

import pytest
import torch

from ragkv.generation import GenerationConfig, decode_loop, generate_ids
from ragkv.model import ModelAdapter
from ragkv.model.attention import _one_query_fp32, decode_step
from ragkv.model.decode import StaticDecoder
from ragkv.model.quant import quantize_int4, quantize_int8
from tests.conftest import make_model


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (n,), generator=g).tolist()


def _plain_logits(adapter: ModelAdapter, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` of the model's own forward (no ragkv cache, no adapter)."""
    with torch.no_grad():
        return adapter.model(input_ids=torch.tensor([ids])).logits[0].float()


def _tolerance(dtype: torch.dtype) -> float:
    """Logit error allowed between two correct computations in ``dtype`` (unit roundoff x headroom)."""
    return 64 * torch.finfo(dtype).eps if dtype == torch.float32 else 8 * torch.finfo(dtype).eps


def test_decode_steps_give_the_plain_forwards_logits(tiny_adapter):
    a = tiny_adapter
    prompt, answer = _ids(40, 1), _ids(12, 2)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    session = StaticDecoder(a).session(cache, len(prompt), len(answer))
    got = torch.stack([session.step(t) for t in answer])  # [answer, vocab]
    want = _plain_logits(a, prompt + answer)[len(prompt) :]
    scale = want.abs().max()
    assert (got - want).abs().max() <= _tolerance(a.dtype) * scale
    assert session.length == len(prompt) + len(answer)


def test_greedy_static_decode_equals_the_reference_decode(tiny_adapter):
    a = tiny_adapter
    context, suffix = _ids(30, 3), _ids(6, 4)
    kv = a.prefill_kv(context)
    want = generate_ids(a, [kv], suffix, 16)
    cache = a.build_cache([kv])
    first = a.forward(suffix, cache, len(context), logits="last")[-1]
    start = len(context) + len(suffix)
    session = StaticDecoder(a).session(cache, start, 16)
    cfg = GenerationConfig(max_new_tokens=16)
    assert list(decode_loop(a, cache, first, start, cfg, step=session.step)) == want


def test_a_session_leaves_the_given_cache_alone_and_refuses_to_overflow(llama_adapter):
    a = llama_adapter
    cache = a.build_cache([a.prefill_kv(_ids(10, 5))])
    before = [layer.keys.clone() for layer in cache.layers]
    session = StaticDecoder(a).session(cache, 10, 2)
    session.step(1)
    session.step(2)
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, cache.layers, strict=True))
    with pytest.raises(ValueError, match="larger max_new_tokens"):
        session.step(3)
    with pytest.raises(ValueError, match="fewer than the prompt"):
        StaticDecoder(a).session(cache, 11, 2)
    with pytest.raises(ValueError, match="decode weights must be one of"):
        StaticDecoder(a, weights="int2")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_one_query_fp32_attention_equals_plain_softmax_attention(dtype, masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 16, generator=g).to(dtype)  # [B, Hq, 1, D], 4 query heads per KV head
    k, v = (torch.randn(2, 2, 33, 16, generator=g).to(dtype) for _ in range(2))  # [B, Hkv, S, D]
    mask = None
    if masked:  # row 0 may not see its first 5 slots (left padding in a batch)
        mask = torch.zeros(2, 1, 1, 33, dtype=dtype)
        mask[0, ..., :5] = torch.finfo(dtype).min
    got, _ = _one_query_fp32(q, k, v, mask, 0.25)
    kr, vr = k.float().repeat_interleave(4, dim=1), v.float().repeat_interleave(4, dim=1)
    scores = q.float() @ kr.transpose(-1, -2) * 0.25
    if mask is not None:
        scores = scores + mask.float()
    want = (scores.softmax(-1) @ vr).to(dtype).transpose(1, 2)  # [B, 1, Hq, D]
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    bool_mask = None if mask is None else mask == 0  # True = may attend
    torch.testing.assert_close(_one_query_fp32(q, k, v, bool_mask, 0.25)[0], got)


def test_bf16_static_decode_stays_within_bf16_error_of_the_fp32_forward(tiny_tokenizer):
    model32 = make_model("qwen2", len(tiny_tokenizer))
    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)).to(torch.bfloat16), tiny_tokenizer)
    prompt, answer = _ids(50, 6), _ids(8, 7)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    session = StaticDecoder(a).session(cache, len(prompt), len(answer))
    got = torch.stack([session.step(t) for t in answer])
    with torch.no_grad():
        want = model32(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) :].float()
    ref = _plain_logits(a, prompt + answer)[len(prompt) :]  # the bf16 model's own forward
    # the fast path's error against fp32 is no larger (within noise) than the plain bf16 forward's
    assert (got - want).abs().max() <= 1.5 * (ref - want).abs().max() + 1e-3


def test_int8_weights_round_trip_within_half_a_step_per_channel():
    w = torch.randn(32, 64) * torch.linspace(0.01, 3, 32).unsqueeze(1)
    w[5] = 0
    q, scales = quantize_int8(w, torch.float32)
    assert q.dtype == torch.int8 and scales.shape == (32,)
    err = (q.float() * scales.unsqueeze(1) - w).abs()
    assert torch.all(err <= scales.unsqueeze(1) / 2 + 1e-7)
    assert torch.equal(q[5], torch.zeros(64, dtype=torch.int8))


def test_int8_decode_is_close_and_touches_neither_prefill_nor_the_fingerprint(tiny_tokenizer):
    a = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    prompt, answer = _ids(30, 8), _ids(6, 9)
    fingerprint = a.fingerprint
    before = _plain_logits(a, prompt)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    exact = StaticDecoder(a).session(cache, len(prompt), len(answer))
    want = torch.stack([exact.step(t) for t in answer])
    int8 = StaticDecoder(a, weights="int8").session(cache, len(prompt), len(answer))
    got = torch.stack([int8.step(t) for t in answer])
    assert not torch.equal(got, want)  # the int8 copies are what the steps read
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).max()) < 0.05
    assert torch.equal(_plain_logits(a, prompt), before)  # outside decode steps: the model's weights
    a._fingerprint = None
    assert a.fingerprint == fingerprint


def test_a_whole_forward_inside_a_decode_step_matches_the_delegated_attention(llama_adapter):
    a, ids = llama_adapter, _ids(20, 10)
    cache1, cache2 = a.build_cache([]), a.build_cache([])
    first = a.forward(ids[:-1], cache1, 0, logits="none")
    a.forward(ids[:-1], cache2, 0, logits="none")
    plain = a.forward(ids[-1:], cache1, len(ids) - 1)
    with decode_step():
        fast = a.forward(ids[-1:], cache2, len(ids) - 1)
    assert first.shape[0] == 0
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)


def test_a_model_weights_decoder_reads_the_model_weights_after_int8_was_installed(tiny_tokenizer):
    a = ModelAdapter(make_model("qwen3", len(tiny_tokenizer)), tiny_tokenizer)
    prompt, answer = _ids(20, 11), _ids(4, 12)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    before = torch.stack([StaticDecoder(a).session(cache, 20, 4).step(t) for t in answer[:1]])
    StaticDecoder(a, weights="int8")  # installs the copies on the shared modules
    after = torch.stack([StaticDecoder(a).session(cache, 20, 4).step(t) for t in answer[:1]])
    assert torch.equal(before, after)


@pytest.mark.slow
def test_the_default_model_decodes_greedily_as_the_reference_and_stays_tied(real_adapter):
    a = real_adapter
    # its GGUF has no output tensor: the LM head is the embedding matrix, one copy
    assert a.model.lm_head.weight.data_ptr() == a.model.model.embed_tokens.weight.data_ptr()
    prompt = a.encode(
        "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n"
    )
    want = generate_ids(a, [], prompt, 48)
    cache = a.build_cache([])
    first = a.forward(prompt, cache, 0, logits="last")[-1]
    session = StaticDecoder(a).session(cache, len(prompt), 48)
    got = list(decode_loop(a, cache, first, len(prompt), GenerationConfig(max_new_tokens=48), step=session.step))
    assert len(want) > 10 and got == want


def test_int4_weights_round_trip_within_half_a_step_per_group():
    w = torch.randn(16, 96) * torch.linspace(0.01, 3, 96)  # groups of 32 columns with different ranges
    q, sz = quantize_int4(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (3, 16, 2)
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()  # [out, groups]
    deq = (q.float().reshape(16, 3, 32) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    # half a step, plus the bf16 rounding of the scale and offset
    assert torch.all((deq.reshape(16, 96) - w).abs() <= scale.repeat_interleave(32, 1) * 0.5 + 0.02 * w.abs().max())


def test_int4_decode_kernel_equals_the_dequantized_weights(tiny_tokenizer):
    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    prompt, answer = _ids(24, 13), _ids(5, 14)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    exact = StaticDecoder(a).session(cache, len(prompt), len(answer))
    want = torch.stack([exact.step(t) for t in answer])
    int4 = StaticDecoder(a, weights="int4").session(cache, len(prompt), len(answer))
    got = torch.stack([int4.step(t) for t in answer])
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert 0 < float(kl.sum(-1).max()) < 0.2
    # the kernel computes x @ dequantized(W).T: one layer checked against its own dequantized copy
    linear = a.model.model.layers[0].mlp.down_proj
    q, sz = quantize_int4(linear.weight)
    groups = linear.in_features // 32
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()
    deq = ((q.float().reshape(-1, groups, 32) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(q.shape)
    x = torch.randn(3, linear.in_features)
    from ragkv.model.quant import step_weights

    with step_weights("int4"), torch.no_grad():
        fast = linear(x)
    torch.testing.assert_close(fast, x.to(torch.bfloat16).float() @ deq.t(), atol=0.05, rtol=0.02)
