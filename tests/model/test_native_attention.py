"""ragkv.model.native_attention: the AVX512-BF16 kernel against attention computed in fp64, and in fusion."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragkv.fusion import FusionConfig, FusionInput, _question_attention, fuse
from ragkv.model import ModelAdapter, attention
from ragkv.model import native_attention as na
from ragkv.model.attention import PLAIN, Steer
from ragkv.model.caches import ScatterCache
from tests.conftest import make_model
from tests.core.test_model import _ids

needs_kernel = pytest.mark.skipif(not na.attention_available(), reason="no C compiler, or no AVX512-BF16 on this CPU")
needs_fp32_kernel = pytest.mark.skipif(
    not na.attention_available(torch.float32), reason="no C compiler, or no AVX2 and FMA on this CPU"
)


def _operands(hq, hkv, q, keys, d, seed=0, order="sorted", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(1, hq, q, d, generator=g) * 2).to(dtype)
    key, value = (torch.randn(1, hkv, keys, d, generator=g).to(dtype) for _ in range(2))
    if order == "tail":  # the last q slots, as a prefill piece's queries
        pos = torch.arange(keys - q, keys)
    elif order == "zero":  # every query at slot 0: one key each
        pos = torch.zeros(q, dtype=torch.long)
    else:
        pos = torch.randperm(keys, generator=g)[:q]
        pos = torch.sort(pos).values if order == "sorted" else pos
    return query, key, value, pos


def _exact(query, key, value, pos, scale):
    """The attention in fp64: each query over the keys at slots <= its own, heads grouped. [1, q, Hq, D]"""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (key, value))
    blocked = torch.arange(key.shape[2]).unsqueeze(0) > pos.unsqueeze(1)
    mask = torch.zeros(blocked.shape, dtype=torch.float64).masked_fill_(blocked, float("-inf"))
    out = F.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _torch_sdpa(query, key, value, pos, scale):
    """What transformers' SDPA path computes: K/V repeated, an additive mask. [1, q, Hq, D]"""
    groups = query.shape[1] // key.shape[1]
    blocked = torch.arange(key.shape[2]).unsqueeze(0) > pos.unsqueeze(1)
    mask = torch.zeros(blocked.shape, dtype=query.dtype).masked_fill_(blocked, torch.finfo(query.dtype).min)
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize(
    ("hq", "hkv", "q", "keys", "d"),
    [
        (1, 1, 1, 1, 64),
        (4, 4, 5, 17, 64),
        (9, 3, 37, 200, 64),
        (14, 2, 33, 100, 64),
        (4, 2, 20, 70, 128),
        (6, 3, 3, 40, 192),
    ],
)
@pytest.mark.parametrize("order", ["sorted", "unsorted", "tail", "zero"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_the_exact_attention_rounded_once(hq, hkv, q, keys, d, order, threads):
    query, key, value, pos = _operands(hq, hkv, q, keys, d, seed=hq * 100 + keys, order=order)
    scale = d**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = na.scatter_attention(query, key, value, pos, scale)
    finally:
        torch.set_num_threads(before)
    exact = _exact(query, key, value, pos, scale)
    assert got.shape == (1, q, hq, d) and got.dtype == torch.bfloat16
    # fp32 arithmetic, then one rounding to bf16: within half a bf16 step of the exact value, nearly
    # always the exact value rounded
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
    rounded = exact.float().bfloat16()
    assert (got == rounded).double().mean() >= 0.99


@needs_fp32_kernel
@pytest.mark.parametrize(
    ("hq", "hkv", "q", "keys", "d"),
    [(1, 1, 1, 1, 16), (4, 4, 5, 17, 16), (9, 3, 37, 200, 64), (14, 2, 33, 100, 48), (4, 2, 20, 70, 128)],
)
@pytest.mark.parametrize("order", ["sorted", "unsorted", "tail", "zero"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fp32_kernel_is_the_exact_attention_to_fp32s_precision(hq, hkv, q, keys, d, order, threads):
    query, key, value, pos = _operands(hq, hkv, q, keys, d, seed=hq * 100 + keys, order=order, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = na.scatter_attention(query, key, value, pos, d**-0.5)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (1, q, hq, d) and got.dtype == torch.float32
    exact = _exact(query, key, value, pos, d**-0.5)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    torchs = _torch_sdpa(query, key, value, pos, d**-0.5).double()
    assert (got.double() - exact).abs().mean() <= 2 * (torchs - exact).abs().mean() + 1e-7


@needs_kernel
def test_the_kernel_is_closer_to_the_exact_attention_than_torchs_sdpa():
    query, key, value, pos = _operands(9, 3, 300, 1535, 64)
    exact = _exact(query, key, value, pos, 0.125)
    ours = (na.scatter_attention(query, key, value, pos, 0.125).double() - exact).abs()
    torchs = (_torch_sdpa(query, key, value, pos, 0.125).double() - exact).abs()
    assert ours.mean() < torchs.mean() and ours.max() <= torchs.max()


@needs_kernel
def test_strided_views_and_spare_slots_give_the_same_result():
    query, key, value, pos = _operands(4, 2, 24, 90, 64, order="unsorted")
    want = na.scatter_attention(query, key, value, pos, None)  # None: 1/sqrt(d)
    as_passed = query.transpose(1, 2).contiguous().transpose(1, 2)  # [1, q, H, D] viewed as [1, H, q, D]
    big_k, big_v = (torch.cat([t, torch.full_like(t, 7.0)], dim=2) for t in (key, value))  # slots past the keys
    got = na.scatter_attention(as_passed, big_k, big_v, pos, 64**-0.5)
    assert not as_passed.is_contiguous() and torch.equal(got, want)
    torch.testing.assert_close(want.double(), _exact(query, key, value, pos, 0.125), rtol=2**-8, atol=1e-5)


@needs_kernel
def test_positions_outside_the_slots_are_refused():
    query, key, value, pos = _operands(2, 1, 4, 10, 64)
    with pytest.raises(ValueError, match="lie in"):
        na.scatter_attention(query, key, value, torch.tensor([0, 1, 2, 10]), None)
    with pytest.raises(ValueError, match="lie in"):
        na.scatter_attention(query, key, value, torch.tensor([0, -1, 2, 3]), None)
    with pytest.raises(ValueError, match="one slot per query"):
        na.scatter_attention(query, key, value, torch.tensor([0, 1]), None)
    assert na.scatter_attention(query[:, :, :0], key, value, torch.zeros(0, dtype=torch.long), None).shape == (
        1,
        0,
        2,
        64,
    )


def test_calls_the_kernel_does_not_compute_are_left_to_the_model():
    query, key, value, _ = _operands(4, 2, 3, 10, 64)
    ok = na.attention_available()
    assert na.scatter_applies(query, key, value, {"dropout": 0.0, "scaling": 0.125, "sliding_window": None}) == ok
    for kwargs in ({"sliding_window": 4}, {"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"dropout": 0.1}):
        assert not na.scatter_applies(query, key, value, kwargs)
    fp32 = (query.float(), key.float(), value.float())
    assert na.scatter_applies(*fp32, {}) == na.attention_available(torch.float32)  # the AVX2 kernel
    assert not na.scatter_applies(query.half(), key.half(), value.half(), {})  # fp16: no kernel
    assert not na.scatter_applies(query[..., :32], key[..., :32], value[..., :32], {})  # bf16 head size 32
    assert not na.scatter_applies(*(t[..., :8] for t in fp32), {})  # fp32 head size 8
    assert not na.scatter_applies(query, key.float(), value, {})  # dtypes that differ
    assert not na.scatter_applies(query[:, :3], key, value, {})  # 3 query heads over 2 KV heads
    assert not na.scatter_applies(query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1), value, {})  # a batch


def _bf16_adapter(tokenizer, family="llama", **overrides) -> ModelAdapter:
    """A tiny random model with 64-wide heads (the kernel's smallest), in bf16."""
    model = make_model(family, len(tokenizer), seed=3, head_dim=64, **overrides).to(torch.bfloat16)
    return ModelAdapter(model, tokenizer, name=f"tiny-{family}-bf16")


def _prompt(adapter: ModelAdapter):
    prefix, chunk_ids, suffix = _ids(9, 0), [_ids(n, 10 + i) for i, n in enumerate((40, 33, 47))], _ids(6, 99)
    pre = adapter.prefill_kv(prefix)
    chunks = [adapter.prefill_kv(c, past=[pre]) for c in chunk_ids]
    return prefix + sum(chunk_ids, []), suffix, FusionInput(pre, chunks, chunk_ids, suffix)


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_full_recompute_in_bf16_runs_the_kernel_and_is_as_close_to_fp64_as_torchs_path(
    tiny_tokenizer, monkeypatch, family
):
    adapter = _bf16_adapter(tiny_tokenizer, family)
    ctx, suffix, inp = _prompt(adapter)
    counted = _Counted(na.scatter_attention)
    monkeypatch.setattr(attention, "scatter_attention", counted)
    fused = fuse(adapter, inp, FusionConfig(method="full"), prefill_suffix=True)
    assert counted.calls == adapter.spec.num_layers  # every layer of the recompute pass
    with monkeypatch.context() as m:
        m.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)  # torch's SDPA with the mask
        plain = fuse(adapter, inp, FusionConfig(method="full"), prefill_suffix=True)
    assert counted.calls == adapter.spec.num_layers
    exact_model = make_model(family, len(tiny_tokenizer), seed=3, head_dim=64).to(torch.bfloat16).double()
    exact_adapter = ModelAdapter(exact_model, tiny_tokenizer, name="fp64")
    exact = exact_adapter.forward(ctx + suffix, exact_adapter.build_cache([]), 0)[-len(suffix) :]
    ours = (fused.suffix_logits.double() - exact.double()).abs().mean()
    torchs = (plain.suffix_logits.double() - exact.double()).abs().mean()
    assert ours <= torchs * 1.25 + 1e-3
    torch.testing.assert_close(fused.suffix_logits, plain.suffix_logits, atol=0.15, rtol=0.05)


@needs_kernel
def test_a_sliding_window_model_keeps_torchs_attention(tiny_tokenizer, monkeypatch):
    adapter = _bf16_adapter(tiny_tokenizer, "mistral", sliding_window=256)  # wider than the prompt
    _, _, inp = _prompt(adapter)
    counted = _Counted(na.scatter_attention)
    monkeypatch.setattr(attention, "scatter_attention", counted)
    fused = fuse(adapter, inp, FusionConfig(method="full"), prefill_suffix=True)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)
    plain = fuse(adapter, inp, FusionConfig(method="full"), prefill_suffix=True)
    assert counted.calls == 0 and torch.equal(fused.suffix_logits, plain.suffix_logits)


def test_passes_are_steered_to_the_kernel_only_where_it_runs(tiny_tokenizer, llama_adapter, monkeypatch):
    pos = torch.tensor([3, 5, 9])
    for adapter, dtype, library in (
        (_bf16_adapter(tiny_tokenizer), torch.bfloat16, na.ATTENTION),
        (llama_adapter, torch.float32, na.ATTENTION_FP32),
    ):
        steer = adapter.scattered(pos)
        if na.attention_available(dtype):
            assert isinstance(steer, Steer) and not steer.plain_attention and torch.equal(steer.query_pos, pos)
        with monkeypatch.context() as m:
            m.setattr(library, "_library", [None])  # as where it cannot be built (RAGKV_NATIVE_KERNELS=0)
            assert adapter.scattered(pos) is PLAIN
    half = ModelAdapter(make_model("llama", len(tiny_tokenizer)).half(), tiny_tokenizer, name="tiny-fp16")
    assert half.scattered(pos) is PLAIN  # no fp16 kernel


def test_switched_off_the_kernels_are_not_built(tmp_path, monkeypatch):
    monkeypatch.setattr(na.ATTENTION, "_library", [])  # a fresh look, as in a new process
    monkeypatch.setattr(na.ATTENTION_FP32, "_library", [])
    monkeypatch.setenv("RAGKV_NATIVE_KERNELS", "0")
    monkeypatch.setenv("RAGKV_KERNEL_CACHE", str(tmp_path))
    assert not na.attention_available() and not na.attention_available(torch.float32)
    assert not any(tmp_path.iterdir())
    for dtype in (torch.bfloat16, torch.float32):
        query, key, value, pos = _operands(2, 1, 4, 10, 64, dtype=dtype)
        with pytest.raises(RuntimeError, match="not available"):
            na.scatter_attention(query, key, value, pos, None)


@needs_kernel
def test_the_profiler_sees_the_kernels_calls_by_name():
    query, key, value, pos = _operands(2, 1, 4, 10, 64)
    with torch.profiler.profile() as prof:
        na.scatter_attention(query, key, value, pos, None)
    assert {e.key: e.count for e in prof.key_averages()}.get(na.PROFILED_NAME) == 1


@needs_kernel
@pytest.mark.parametrize("order", ["tail", "unsorted"])
def test_the_kernel_sums_each_slots_probability_over_heads_and_queries(order):
    query, key, value, pos = _operands(6, 2, 20, 150, 64, order=order)
    weights = torch.full((150,), 5.0)  # every slot set, those past the queries to 0
    na.scatter_attention(query, key, value, pos, 0.125, weights)
    scores = (query.double() @ key.double().repeat_interleave(3, 1).transpose(-1, -2)) * 0.125
    scores = scores.masked_fill(torch.arange(150).unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
    want = scores.softmax(-1).sum(dim=(0, 1, 2))  # what the eager probe records: [slots]
    torch.testing.assert_close(weights.double(), want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="weights must be"):
        na.scatter_attention(query, key, value, pos, 0.125, torch.zeros(149))


@needs_kernel
def test_the_question_probe_on_the_kernel_records_what_the_eager_probe_records(tiny_tokenizer, monkeypatch):
    adapter = _bf16_adapter(tiny_tokenizer)
    _, suffix, inp = _prompt(adapter)
    n_ctx = inp.prefix.num_tokens + sum(len(c) for c in inp.chunk_ids)
    placed, offset = [inp.prefix], inp.prefix.num_tokens
    for kv in inp.chunks:
        placed.append(adapter.rerotate(kv, offset))
        offset += kv.num_tokens
    cache = adapter.build_cache(placed)
    pad = torch.zeros(1, cache.layers[0].keys.shape[1], len(suffix), 64, dtype=torch.bfloat16)
    k = torch.cat([torch.cat([layer.keys, pad], 2) for layer in cache.layers])
    v = torch.cat([torch.cat([layer.values, pad], 2) for layer in cache.layers])
    slots = torch.arange(inp.prefix.num_tokens, n_ctx)
    counted = _Counted(na.scatter_attention)
    monkeypatch.setattr(attention, "scatter_attention", counted)
    got = _question_attention(adapter, k.clone(), v.clone(), torch.tensor(suffix), n_ctx, slots)
    assert counted.calls == adapter.spec.num_layers
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)
    eager = _question_attention(adapter, k.clone(), v.clone(), torch.tensor(suffix), n_ctx, slots)
    assert counted.calls == adapter.spec.num_layers and got.shape == eager.shape == (
        adapter.spec.num_layers,
        len(slots),
    )
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-7)  # both fp32 over the same bf16 layers


@needs_kernel
def test_concurrent_calls_from_several_threads_each_get_their_own_result():
    from concurrent.futures import ThreadPoolExecutor

    cases = [_operands(9, 3, 40 + i, 300 + 17 * i, 64, seed=i, order="unsorted") for i in range(6)]
    alone = [na.scatter_attention(*c, 0.125) for c in cases]
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):
            together = list(pool.map(lambda c: na.scatter_attention(*c, 0.125), cases))
            assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


def _plain_prefill(adapter: ModelAdapter, ids: list[int], piece: int) -> torch.Tensor:
    """Logits of the last token of ``ids`` prefilled in pieces of ``piece`` tokens from an empty cache."""
    cache = adapter.build_cache([])
    for s in range(0, len(ids), piece):
        out = adapter.forward(ids[s : s + piece], cache, s, logits="last")
    return out[-1]


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("piece", [200, 32])  # one pass; chunked prefill after a cached context
def test_a_plain_prefill_in_bf16_runs_the_kernel_and_is_as_close_to_fp64_as_torchs_path(
    tiny_tokenizer, monkeypatch, family, piece
):
    adapter = _bf16_adapter(tiny_tokenizer, family)
    ids = _ids(150, 7)
    counted = _Counted(na.scatter_attention)
    monkeypatch.setattr(attention, "scatter_attention", counted)
    ours = _plain_prefill(adapter, ids, piece)
    assert counted.calls == adapter.spec.num_layers * -(-len(ids) // piece)  # every layer of every piece
    with monkeypatch.context() as m:
        m.setattr(ModelAdapter, "_prefill_steer", lambda self, cache, start, count: PLAIN)
        torchs = _plain_prefill(adapter, ids, piece)
    assert counted.calls == adapter.spec.num_layers * -(-len(ids) // piece)
    exact_model = make_model(family, len(tiny_tokenizer), seed=3, head_dim=64).to(torch.bfloat16).double()
    exact_adapter = ModelAdapter(exact_model, tiny_tokenizer, name="fp64")
    exact = exact_adapter.forward(ids, exact_adapter.build_cache([]), 0)[-1].double()
    assert (ours.double() - exact).abs().mean() <= (torchs.double() - exact).abs().mean() * 1.25 + 1e-3
    torch.testing.assert_close(ours, torchs, atol=0.15, rtol=0.05)


@needs_kernel
def test_a_prefill_keeps_torchs_attention_where_the_kernel_is_not_sure_to_apply_or_pay(
    tiny_tokenizer, llama_adapter, monkeypatch
):
    adapter = _bf16_adapter(tiny_tokenizer)
    counted = _Counted(na.scatter_attention)
    monkeypatch.setattr(attention, "scatter_attention", counted)
    ids = _ids(40, 5)
    cache = adapter.build_cache([])
    adapter.forward(ids[:1], cache, 0)  # one token: a decode-like step
    adapter.forward(ids[1:20], cache, 1)
    assert counted.calls == adapter.spec.num_layers  # only the 19-token piece
    assert adapter._prefill_steer(cache, 7, 5) is PLAIN  # a cache whose length is not the start
    assert adapter._prefill_steer(ScatterCache.__new__(ScatterCache), 0, 5) is PLAIN  # not a DynamicCache
    assert llama_adapter._prefill_steer(llama_adapter.build_cache([]), 0, 5) is PLAIN  # fp32: slower than SDPA
    steer = adapter._prefill_steer(adapter.build_cache([]), 0, 5)
    assert torch.equal(steer.query_pos, torch.arange(5))
