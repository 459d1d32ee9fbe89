"""Decode steps (one row of ragkv.model.batch.DecodeBatch, as every answer runs) against the plain
transformers forward of the same weights; the int8/int4 decode weights (ragkv.model.quant)."""

from __future__ import annotations

import pytest
import torch

from ragkv.generation import generate_ids
from ragkv.model import ModelAdapter, Steer
from ragkv.model.attention import _one_query_fp32
from ragkv.model.batch import DecodeBatch
from ragkv.model.placement import resolve_decode_weights
from ragkv.model.quant import available_formats, quantize_int4, quantize_int8, quantized, time_formats
from tests.conftest import make_model


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (n,), generator=g).tolist()


def _plain_logits(adapter: ModelAdapter, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` of the model's own forward (no ragkv cache, no adapter)."""
    with torch.no_grad():
        return adapter.model(input_ids=torch.tensor([ids])).logits[0].float()


def _steps(a: ModelAdapter, cache, num_tokens: int, tokens: list[int], weights: str = "model") -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` after feeding each of ``tokens`` (teacher forcing) as one row of a batch."""
    batch = DecodeBatch(a, weights=weights)  # type: ignore[arg-type]
    batch.add("row", cache, num_tokens, reserve=len(tokens))
    return torch.stack([batch.step([t])[0] for t in tokens])


def _greedy(a: ModelAdapter, cache, first: torch.Tensor, num_tokens: int, n: int) -> list[int]:
    """Greedy ids decoded as one row of a batch from the prompt's last logits ``first`` (stops at EOS)."""
    batch = DecodeBatch(a)
    batch.add("row", cache, num_tokens, reserve=n)
    out, logits = [], first
    while len(out) < n and int(torch.argmax(logits)) not in a.eos_token_ids:
        out.append(int(torch.argmax(logits)))
        logits = batch.step(out[-1:])[0]
    return out


def _tolerance(dtype: torch.dtype) -> float:
    """Logit error allowed between two correct computations in ``dtype`` (unit roundoff x headroom)."""
    return 64 * torch.finfo(dtype).eps if dtype == torch.float32 else 8 * torch.finfo(dtype).eps


def test_decode_steps_give_the_plain_forwards_logits(tiny_adapter):
    a = tiny_adapter
    prompt, answer = _ids(40, 1), _ids(12, 2)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    got = _steps(a, cache, len(prompt), answer)  # [answer, vocab]
    want = _plain_logits(a, prompt + answer)[len(prompt) :]
    scale = want.abs().max()
    assert (got - want).abs().max() <= _tolerance(a.dtype) * scale


def test_greedy_batch_decode_equals_the_reference_decode(tiny_adapter):
    a = tiny_adapter
    context, suffix = _ids(30, 3), _ids(6, 4)
    kv = a.prefill_kv(context)
    want = generate_ids(a, [kv], suffix, 16)
    cache = a.build_cache([kv])
    first = a.forward(suffix, cache, len(context), logits="last")[-1]
    start = len(context) + len(suffix)
    assert _greedy(a, cache, first, start, 16) == want


def test_a_row_leaves_the_given_cache_alone_and_bad_settings_are_refused(llama_adapter):
    a = llama_adapter
    cache = a.build_cache([a.prefill_kv(_ids(10, 5))])
    before = [layer.keys.clone() for layer in cache.layers]
    _steps(a, cache, 10, [1, 2, 3])
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, cache.layers, strict=True))
    with pytest.raises(ValueError, match="fewer than the prompt"):
        DecodeBatch(a).add("row", cache, 11)
    with pytest.raises(ValueError, match="quantized decode weights are one of"):
        DecodeBatch(a, weights="int2")  # type: ignore[arg-type]


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


def test_bf16_batch_decode_stays_within_bf16_error_of_the_fp32_forward(tiny_tokenizer):
    model32 = make_model("qwen2", len(tiny_tokenizer))
    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)).to(torch.bfloat16), tiny_tokenizer)
    prompt, answer = _ids(50, 6), _ids(8, 7)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    got = _steps(a, cache, len(prompt), answer)
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
    want = _steps(a, cache, len(prompt), answer)
    got = _steps(a, cache, len(prompt), answer, "int8")
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
    fast = a.forward(ids[-1:], cache2, len(ids) - 1, steer=Steer(kind="decode"))
    assert first.shape[0] == 0
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)


def test_model_weights_steps_read_the_model_weights_after_int8_steps_ran(tiny_tokenizer):
    a = ModelAdapter(make_model("qwen3", len(tiny_tokenizer)), tiny_tokenizer)
    prompt, answer = _ids(20, 11), _ids(4, 12)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    before = _steps(a, cache, 20, answer)
    assert not torch.equal(_steps(a, cache, 20, answer, "int8"), before)  # the copies share the model's modules
    assert torch.equal(_steps(a, cache, 20, answer), before)


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
    assert len(want) > 10 and _greedy(a, cache, first, len(prompt), 48) == want


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
    want = _steps(a, cache, len(prompt), answer)
    got = _steps(a, cache, len(prompt), answer, "int4")
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert 0 < float(kl.sum(-1).max()) < 0.2
    # the kernel computes x @ dequantized(W).T: one layer checked against its own dequantized copy
    linear = a.model.model.layers[0].mlp.down_proj
    q, sz = quantize_int4(linear.weight)
    groups = linear.in_features // 32
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()
    deq = ((q.float().reshape(-1, groups, 32) - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(q.shape)
    x = torch.randn(3, linear.in_features)
    with torch.no_grad():
        fast = quantized(a.model, "int4").model.layers[0].mlp.down_proj(x)
        torch.testing.assert_close(linear(x), x @ linear.weight.t())  # the model's own module is untouched
    torch.testing.assert_close(fast, x.to(torch.bfloat16).float() @ deq.t(), atol=0.05, rtol=0.02)


def test_fp16_decode_kernel_equals_the_fp16_rounded_weights(tiny_tokenizer):
    if "fp16" not in available_formats():
        pytest.skip("no FBGEMM in this torch build")
    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    prompt, answer = _ids(24, 13), _ids(5, 14)
    cache = a.build_cache([])
    a.forward(prompt, cache, 0, logits="none")
    want = _steps(a, cache, len(prompt), answer)
    got = _steps(a, cache, len(prompt), answer, "fp16")
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).max()) < 1e-4  # fp16 rounding of the weights only
    copy = quantized(a.model, "fp16")
    for mine, theirs in ((copy.model.layers[0].mlp.down_proj, a.model.model.layers[0].mlp.down_proj),
                         (copy.lm_head, a.model.lm_head)):  # fmt: skip
        x = torch.randn(3, theirs.in_features)
        with torch.no_grad():
            slow = x @ theirs.weight.half().float().t()
            torch.testing.assert_close(mine(x), slow, atol=1e-5, rtol=1e-4)


def test_auto_picks_the_copy_measured_fastest_and_says_so():
    cpu = torch.device("cpu")
    asked: list[tuple[str, ...]] = []

    def timer(formats):
        asked.append(tuple(formats))
        return {"int8": 3.0, "fp16": 1.5}

    weights, why = resolve_decode_weights("auto", cpu, 5, timer=timer)
    if "fp16" not in available_formats():
        assert (weights, asked) == ("int8", [])
        return
    assert weights == "fp16" and asked == [("int8", "fp16")]
    assert "fp16 measured fastest here (int8 3.00 ms, fp16 1.50 ms" in why
    assert resolve_decode_weights("auto", cpu, 5, timer=lambda f: {"int8": 1.0, "fp16": 2.0})[0] == "int8"
    assert resolve_decode_weights("auto", cpu, 16, timer=timer)[0] == "model" and len(asked) == 1  # not timed


def test_time_formats_times_each_format_on_the_models_layers(tiny_tokenizer):
    a = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    times = time_formats(a.model, available_formats(), layers=2, repeats=1)
    assert set(times) == set(available_formats()) and all(t > 0 for t in times.values())


def test_an_fp16_kernel_packed_in_row_blocks_equals_one_packed_whole():
    if "fp16" not in available_formats():
        pytest.skip("no FBGEMM in this torch build")
    from ragkv.model.quant import _fp16_kernel

    linear = torch.nn.Linear(32, 100, bias=False)  # 100 rows in blocks of 16: 7 packs, the last of 4 rows
    x = torch.randn(3, 32)
    with torch.no_grad():
        slow = x @ linear.weight.half().float().t()
        torch.testing.assert_close(_fp16_kernel(linear, torch.float32, block=16)(x), slow, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_fp16_kernel(linear, torch.float32)(x), slow, atol=1e-5, rtol=1e-4)
