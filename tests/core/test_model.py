"""Model adapter exactness on tiny random models of every supported family."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ragkv.errors import ContextTooLongError, UnsupportedModelError
from ragkv.model import ArchSpec, AttentionProbe, ModelAdapter, Steer, concat_kv
from ragkv.types import ChunkKV
from tests.conftest import make_model

ATOL = 1e-4  # fp32; the re-rotation itself is exact to ~1e-6, layer recomputation adds the rest


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _shifted_kv(adapter: ModelAdapter, ids: list[int], start: int):
    """KV of ``ids`` computed with positions start.. (an empty cache shifted in position)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=adapter.model.config)
    adapter.forward(ids, cache, start)
    kv = adapter.cache_to_kv(cache, 0, len(ids), adapter.fingerprint)
    return ChunkKV(kv.keys, kv.values, torch.arange(start, start + len(ids)), kv.model_fingerprint)


def test_arch_spec_reads_config(tiny_adapter):
    s = tiny_adapter.spec
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (4, 4, 2, 16)


def test_rerotate_matches_keys_computed_in_place(tiny_adapter):
    """RoPE attention depends on relative positions only, so a sequence computed at positions
    100.. has the same hidden states; its keys must equal the keys computed at 0.. re-rotated
    by +100 at every layer."""
    ids = _ids(40, 1)
    at0 = _shifted_kv(tiny_adapter, ids, 0)
    at100 = _shifted_kv(tiny_adapter, ids, 100)
    moved = tiny_adapter.rerotate(at0, 100)
    assert torch.equal(moved.positions, torch.arange(100, 140))
    for layer in range(tiny_adapter.spec.num_layers):
        torch.testing.assert_close(moved.keys[layer], at100.keys[layer], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(moved.values, at100.values, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
            "rope_theta": 10000.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ],
    ids=["llama3", "yarn", "linear"],
)
def test_rerotate_exact_for_scaled_rope(tiny_tokenizer, rope):
    model = make_model("llama", len(tiny_tokenizer), rope_parameters=rope)
    adapter = ModelAdapter(model, tiny_tokenizer)
    assert adapter.spec.rope_type == rope["rope_type"]
    ids = _ids(30, 2)
    moved = adapter.rerotate(_shifted_kv(adapter, ids, 7), 900)
    target = _shifted_kv(adapter, ids, 900)
    torch.testing.assert_close(moved.keys, target.keys, atol=ATOL, rtol=1e-4)
    back = adapter.rerotate(moved, 7)
    torch.testing.assert_close(back.keys, _shifted_kv(adapter, ids, 7).keys, atol=ATOL, rtol=1e-4)


def test_rerotate_partial_rotary_moves_the_rotated_dims_only(llama_adapter, monkeypatch):
    """Families rotating only the first dims of each head: the formula written out step by step
    (undo the rotation at the stored positions, apply it at the targets) on those dims; the rest pass."""
    a = llama_adapter
    full_rotary = a.rotary
    rot = a.spec.head_dim // 2

    def partial(positions):
        cos, sin = full_rotary(positions)
        half = cos.shape[-1] // 2  # keep each half's first rot/2 frequencies: a rotary of width rot
        pick = torch.cat([torch.arange(rot // 2), half + torch.arange(rot // 2)])
        return cos[..., pick], sin[..., pick]

    monkeypatch.setattr(a, "rotary", partial)
    kv = a.prefill_kv(_ids(20, 6))
    moved = a.rerotate(kv, 50)
    cos_p, sin_p = partial(kv.positions)
    cos_q, sin_q = partial(torch.arange(50, 70))

    def half_turn(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    k = kv.keys[..., :rot]
    plain = (k * cos_p - half_turn(k) * sin_p) / (cos_p**2 + sin_p**2)
    want = plain * cos_q + half_turn(plain) * sin_q
    torch.testing.assert_close(moved.keys[..., :rot], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(moved.keys[..., rot:], kv.keys[..., rot:])


def test_first_chunk_after_prefix_reproduces_full_prefill(tiny_adapter):
    prefix, c1, c2 = _ids(12, 3), _ids(25, 4), _ids(20, 5)
    full = tiny_adapter.prefill_kv(prefix + c1 + c2)
    pre = tiny_adapter.prefill_kv(prefix)
    first = tiny_adapter.prefill_kv(c1, past=[pre])
    assert torch.equal(first.positions, torch.arange(12, 37))
    ref = full.slice(12, 37)
    torch.testing.assert_close(first.keys, ref.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first.values, ref.values, atol=1e-5, rtol=1e-5)


def test_cache_assembled_from_in_place_chunks_gives_full_logits(tiny_adapter):
    prefix, c1, c2, suffix = _ids(10, 6), _ids(20, 7), _ids(15, 8), _ids(6, 9)
    pre = tiny_adapter.prefill_kv(prefix)
    k1 = tiny_adapter.prefill_kv(c1, past=[pre])
    k2 = tiny_adapter.prefill_kv(c2, past=[pre, k1])
    assembled = tiny_adapter.suffix_logits([pre, k1, k2], suffix)
    full = tiny_adapter.forward(prefix + c1 + c2 + suffix, tiny_adapter.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(assembled, full, atol=1e-4, rtol=1e-4)


def test_forward_computes_logits_only_where_asked(tiny_adapter):
    a, ids = tiny_adapter, _ids(17, 11)
    full_cache, last_cache, none_cache = a.build_cache([]), a.build_cache([]), a.build_cache([])
    full = a.forward(ids, full_cache, 0)
    last = a.forward(ids, last_cache, 0, logits="last")
    none = a.forward(ids, none_cache, 0, logits="none")
    assert full.shape == (17, a.spec.vocab_size) and last.shape == (1, a.spec.vocab_size)
    assert none.shape == (0, a.spec.vocab_size)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)
    for cache in (last_cache, none_cache):  # the cache a pass leaves does not depend on its logits
        for got, want in zip(cache.layers, full_cache.layers, strict=True):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    with pytest.raises(ValueError, match="logits must be one of"):
        a.forward(ids, a.build_cache([]), 0, logits="first")  # type: ignore[arg-type]


def test_eos_token_ids_are_read_once(llama_adapter, monkeypatch):
    first = llama_adapter.eos_token_ids
    assert llama_adapter.tokenizer.convert_tokens_to_ids("<|im_end|>") in first

    def boom() -> None:
        raise AssertionError("the vocabulary was read again")

    monkeypatch.setattr(llama_adapter.tokenizer, "get_vocab", boom)
    assert llama_adapter.eos_token_ids is first


def test_build_cache_rejects_unplaced_chunks(llama_adapter):
    pre = llama_adapter.prefill_kv(_ids(5, 1))
    lone = llama_adapter.prefill_kv(_ids(5, 2))  # positions 0..4, not 5..9
    with pytest.raises(ValueError, match="rerotate"):
        llama_adapter.build_cache([pre, lone])
    with pytest.raises(ValueError, match="different models"):
        concat_kv([pre, type(pre)(pre.keys, pre.values, pre.positions, "other")])


def test_context_too_long_is_a_clear_error(llama_adapter):
    with pytest.raises(ContextTooLongError, match="context"):
        llama_adapter.check_context(llama_adapter.spec.max_context + 1)


def test_unsupported_model_names_what_is_missing(tiny_tokenizer):
    class NotADecoder(torch.nn.Module):
        config = type(
            "C",
            (),
            {"model_type": "toy", "num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 4, "vocab_size": 8},
        )()

    with pytest.raises(UnsupportedModelError, match="embed_tokens"):
        ArchSpec.from_model(NotADecoder())


def test_sliding_window_layers_limit_the_context_to_the_window(tiny_tokenizer):
    """Per-layer sliding windows are honoured by keeping prompts inside the window (tests/model)."""
    model = make_model("qwen2", len(tiny_tokenizer), use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert ArchSpec.from_model(model).max_context == 15


@pytest.mark.parametrize(
    ("family", "overrides", "named"),
    [("cohere", {}, "logit_scale"), ("granite", {"embedding_multiplier": 12.0}, "embedding_multiplier")],
)
def test_families_scaling_outside_their_layers_are_refused(tiny_tokenizer, family, overrides, named):
    """Fusion runs embed -> layers -> head itself; a family scaling logits or embeddings in its forward
    would get wrong logits silently (Cohere's logits came out 16x too large before this check)."""
    model = make_model(family, len(tiny_tokenizer), **overrides)
    with pytest.raises(UnsupportedModelError, match=named):
        ArchSpec.from_model(model)


def test_fingerprints_are_stable_and_weight_specific(tiny_tokenizer):
    a = ModelAdapter(make_model("llama", len(tiny_tokenizer), seed=0), tiny_tokenizer)
    b = ModelAdapter(make_model("llama", len(tiny_tokenizer), seed=0), tiny_tokenizer)
    c = ModelAdapter(make_model("llama", len(tiny_tokenizer), seed=1), tiny_tokenizer)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.tokenizer_fingerprint == c.tokenizer_fingerprint


def test_chat_segments_tokenize_to_the_rendered_prompt(llama_adapter):
    pre, chunks, suf = llama_adapter.chat_segments(None, ["alpha text", "beta"], "why?")
    text = llama_adapter.decode(pre + sum(chunks, []) + suf, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and "alpha text\n\nbeta\n\n" in text
    assert text.endswith("Question: why?<|im_end|>\n<|im_start|>assistant\n")


def test_the_dispatcher_delegates_to_the_loaded_attention_exactly(tiny_tokenizer):
    """Making an adapter switches attention to ragkv's dispatcher once; unprobed forwards are bit for
    bit what the implementation the model was loaded with gives (sdpa here, eager below)."""
    for impl in ("sdpa", "eager"):
        model = make_model("llama", len(tiny_tokenizer))
        model.config._attn_implementation = impl
        ids = torch.tensor([_ids(24, 3)])
        with torch.no_grad():
            before = model(input_ids=ids).logits
        adapter = ModelAdapter(model, tiny_tokenizer)
        assert model.config._attn_implementation == f"ragkv_{impl}"
        with torch.no_grad():
            after = model(input_ids=ids).logits
        assert torch.equal(before, after)
        ModelAdapter(model, tiny_tokenizer)  # a second adapter on the same model keeps the dispatcher
        assert model.config._attn_implementation == f"ragkv_{impl}"
        assert torch.equal(adapter.forward(ids[0], adapter.build_cache([]), 0), after[0])


def test_the_probe_records_the_causal_attention_of_a_whole_forward(tiny_tokenizer):
    """Probing a plain multi-token forward (where sdpa's mask builder returns no mask) records the
    causal attention: the same weights an eager model returns with output_attentions."""
    sdpa = make_model("llama", len(tiny_tokenizer))
    eager = make_model("llama", len(tiny_tokenizer))
    eager.config._attn_implementation = "eager"
    adapter = ModelAdapter(sdpa, tiny_tokenizer)
    ids = _ids(20, 4)
    probe = AttentionProbe(None)
    adapter.forward(ids, adapter.build_cache([]), 0, steer=Steer(probe=probe))
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer, probs in enumerate(attentions):  # probs: [1, heads, q, kv]
        torch.testing.assert_close(probe.weights[layer], probs.sum(dim=(0, 1, 2)), atol=1e-5, rtol=1e-5)


def test_threads_probing_and_not_get_what_one_thread_gets(tiny_tokenizer):
    """Issue 9: the probe switched the shared config, so other threads' forwards ran in probe mode and a
    probing thread could be switched back mid-pass (KeyError on the layers it missed). Probing is now
    an argument of the pass (issue 32: ``Steer(probe=...)``): results match a single thread's and the
    model's attention setting never changes."""
    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    impl = adapter.model.config._attn_implementation
    layers = adapter.spec.num_layers

    def plain(seed: int) -> list[torch.Tensor]:
        return [adapter.forward(_ids(16, seed), adapter.build_cache([]), 0)]

    def probed(seed: int) -> list[torch.Tensor]:
        ids, cache = _ids(16, seed), adapter.build_cache([])
        adapter.forward(ids[:-1], cache, 0)
        probe = AttentionProbe(None)
        logits = adapter.forward(ids[-1:], cache, len(ids) - 1, steer=Steer(probe=probe))
        return [logits, torch.stack([probe.weights[i] for i in range(layers)])]

    jobs = [(probed if k % 2 else plain, k % 5) for k in range(160)]
    want = [fn(seed) for fn, seed in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda job: job[0](job[1]), jobs))
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    assert adapter.model.config._attn_implementation == impl


def test_the_half_precision_probe_computes_as_transformers_eager_attention(monkeypatch):
    """On a GPU with a bf16/fp16 model the probe's products run in the model's dtype (tensor cores).
    Forced here on the CPU: the grouped computation equals eager attention done the obvious way
    (K/V repeated per query head, products in bf16, softmax in fp32), and its weights stay close to
    the fp32 probe's."""
    from transformers.models.llama.modeling_llama import repeat_kv

    import ragkv.model.attention as attention

    g = torch.Generator().manual_seed(3)
    hq, hkv, q_len, kv_len, d = 8, 2, 5, 40, 16
    query = torch.randn(1, hq, q_len, d, generator=g).bfloat16()
    key = torch.randn(1, hkv, kv_len, d, generator=g).bfloat16()
    value = torch.randn(1, hkv, kv_len, d, generator=g).bfloat16()
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    full = attention.AttentionProbe(None)
    want_full, _ = attention._probe_attention(full, 0, query, key, value, mask, None)
    monkeypatch.setattr(attention, "_half_products", lambda q: True)
    half = attention.AttentionProbe(None)
    got, _ = attention._probe_attention(half, 0, query, key, value, mask, None)
    # the obvious way: transformers' eager attention
    scores = torch.matmul(query, repeat_kv(key, hq // hkv).transpose(2, 3)).float() * d**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    want = torch.matmul(probs.to(torch.bfloat16), repeat_kv(value, hq // hkv)).transpose(1, 2)
    torch.testing.assert_close(half.weights[0], probs.sum(dim=(0, 1, 2)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # bf16 sums in another order
    torch.testing.assert_close(half.weights[0], full.weights[0], atol=0.05, rtol=0.05)
    torch.testing.assert_close(got.float(), want_full.float(), atol=0.05, rtol=0.05)


def test_number_runs_join_digits_and_the_separators_between_them(tiny_tokenizer):
    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    text = "had 18,420 people in 2021; 3 hours 40, or 03:40 and 3.5 marks."
    ids = torch.tensor(adapter.encode(text))
    runs = adapter.number_runs(ids).tolist()
    pieces = [adapter.decode([i]) for i in ids.tolist()]
    # the obvious way: group tokens by run id and read back each number's text
    numbers: dict[int, str] = {}
    for piece, run in zip(pieces, runs, strict=True):
        if run >= 0:
            numbers[run] = numbers.get(run, "") + piece
    assert [n.strip() for _, n in sorted(numbers.items())] == ["18,420", "2021", "3", "40", "03:40", "3.5"]
    assert sorted(numbers) == list(range(len(numbers)))
    assert adapter.number_runs(torch.zeros(0, dtype=torch.long)).numel() == 0
