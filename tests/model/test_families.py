"""The family matrix: every family is exact under ragkv's cache moves or refused at load, nothing between.

Exact means: re-rotating a chunk from offset A to offset B equals computing it at B, at every layer;
a chunk computed alone and moved behind another has the in-place keys where only token and position
matter (layer 0); full recomputation equals full prefill.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from ragkv.errors import ContextTooLongError, UnsupportedModelError
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.model.rotary import move_keys
from ragkv.types import ChunkKV
from tests.conftest import make_model
from tests.model.families import FAMILIES

ATOL = 1e-4
_EXACT = [f for f in FAMILIES if f[3] == "exact"]
_REFUSED = [f for f in FAMILIES if f[3] != "exact"]


def _ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _shifted_kv(adapter: ModelAdapter, ids: list[int], start: int) -> ChunkKV:
    """KV of ``ids`` run alone at positions ``start..``."""
    cache = DynamicCache(config=adapter.model.config)
    adapter.forward(ids, cache, start)
    kv = adapter.cache_to_kv(cache, 0, len(ids), adapter.fingerprint)
    return ChunkKV(kv.keys, kv.values, torch.arange(start, start + len(ids)), kv.model_fingerprint)


@pytest.fixture(scope="module", params=_EXACT, ids=[f[0] for f in _EXACT])
def family_adapter(request, tiny_tokenizer):
    _, model_type, overrides, _ = request.param
    return ModelAdapter(make_model(model_type, len(tiny_tokenizer), **dict(overrides)), tiny_tokenizer)


@pytest.mark.parametrize(("model_type", "overrides", "reason"), [f[1:] for f in _REFUSED], ids=[f[0] for f in _REFUSED])
def test_family_is_refused_at_load_with_its_reason(tiny_tokenizer, model_type, overrides, reason):
    model = make_model(model_type, len(tiny_tokenizer), **dict(overrides))
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelAdapter(model, tiny_tokenizer)


def test_rerotation_equals_computing_at_the_target_at_every_layer(family_adapter):
    a = family_adapter
    ids = _ids(20, 1)
    moved = a.rerotate(_shifted_kv(a, ids, 5), 60)
    at60 = _shifted_kv(a, ids, 60)
    for layer in range(a.spec.num_layers):
        torch.testing.assert_close(moved.keys[layer], at60.keys[layer], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(moved.values, at60.values, atol=ATOL, rtol=1e-4)


def _prompt(a: ModelAdapter):
    prefix, chunk_ids, suffix = _ids(9, 2), [_ids(17, 3), _ids(20, 4), _ids(13, 5)], _ids(5, 6)
    pre = a.prefill_kv(prefix)
    chunks = [a.prefill_kv(c, past=[pre]) for c in chunk_ids]  # each alone after the prefix
    return prefix, chunk_ids, suffix, FusionInput(pre, chunks, chunk_ids, suffix)


def test_a_moved_chunk_has_the_in_place_keys_where_only_token_and_position_matter(family_adapter):
    """Layer 0's keys depend on the token and its position only, so the second and third chunks,
    computed right after the prefix and moved behind the chunks before them, must match full prefill
    there (this is what wrong pairing or rotating a NoPE layer breaks; full recomputation hides it)."""
    a = family_adapter
    prefix, chunk_ids, _, inp = _prompt(a)
    full = a.prefill_kv(prefix + sum(chunk_ids, []))
    offset = inp.prefix.num_tokens
    for kv in inp.chunks:
        moved = a.rerotate(kv, offset)
        ref = full.slice(offset, offset + kv.num_tokens)
        torch.testing.assert_close(moved.keys[0], ref.keys[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(moved.values[0], ref.values[0], atol=ATOL, rtol=1e-4)
        offset += kv.num_tokens


def test_full_recomputation_equals_full_prefill(family_adapter):
    a = family_adapter
    prefix, chunk_ids, suffix, inp = _prompt(a)
    fused = fuse(a, inp, FusionConfig(method="full"))
    got = a.forward(suffix, fused.cache, fused.num_tokens)
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)


def test_default_fusion_runs(family_adapter):
    _, _, suffix, inp = _prompt(family_adapter)
    fused = fuse(family_adapter, inp, FusionConfig())
    assert 0 < fused.recomputed_tokens < sum(kv.num_tokens for kv in inp.chunks)
    assert torch.isfinite(family_adapter.forward(suffix, fused.cache, fused.num_tokens)).all()


def test_interleaved_rope_needs_the_models_own_pairing(tiny_tokenizer):
    """GLM-4 pairs dims (0, 1), (2, 3)...: the half-split rotation moves its keys about as wrongly as
    not rotating at all (issue 10); the model's own function moves them exactly."""
    a = ModelAdapter(make_model("glm4", len(tiny_tokenizer)), tiny_tokenizer)
    ids = _ids(20, 7)
    at5, at60 = _shifted_kv(a, ids, 5), _shifted_kv(a, ids, 60)
    tables = (*a.rotary(at5.positions), *a.rotary(at60.positions))
    half_split = move_keys(at5.keys, *tables)
    assert (half_split - at60.keys).abs().max() > 0.1 * at60.keys.abs().max()
    torch.testing.assert_close(a.rerotate(at5, 60).keys, at60.keys, atol=ATOL, rtol=1e-4)


def test_nope_layers_are_found_from_what_the_model_does(tiny_tokenizer):
    a = ModelAdapter(make_model("smollm3", len(tiny_tokenizer), no_rope_layers=[0, 1, 1, 0]), tiny_tokenizer)
    assert a.rotated_layers.tolist() == [False, True, True, False]


@pytest.mark.parametrize("model_type", ["mistral", "phi3", "starcoder2"])
def test_config_level_sliding_window_limits_prompts_to_the_window(tiny_tokenizer, model_type):
    """Mistral-7B-v0.1, Phi-3-mini-4k, Starcoder2: up to window - 1 tokens the window never bites
    (exact, tests above); past it a clear error, not a shape ValueError or a silently different cache."""
    a = ModelAdapter(make_model(model_type, len(tiny_tokenizer), sliding_window=32), tiny_tokenizer)
    assert a.spec.max_context == 31
    with pytest.raises(ContextTooLongError, match="31-token"):
        a.prefill_kv(_ids(40, 8))


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_longrope_limits_prompts_to_the_original_context(tiny_tokenizer, model_type):
    """Past the original context transformers switches the whole sequence to the long factors, so a
    cache computed before no longer matches: such prompts are refused, shorter ones are exact (above)."""
    overrides = dict(FAMILIES[[f[0] for f in FAMILIES].index(f"{model_type}-longrope")][2])
    a = ModelAdapter(make_model(model_type, len(tiny_tokenizer), **overrides), tiny_tokenizer)
    assert a.spec.max_context == 256
    ids = _ids(260, 9)
    short = _shifted_kv(a, ids[:200], 0)
    long = _shifted_kv(a, ids, 0)  # the model itself, past the original context
    assert (long.keys[1, :, :200] - short.keys[1]).abs().max() > 1e-2  # the frequencies did switch
    with pytest.raises(ContextTooLongError):
        a.prefill_kv(ids)
    # fusion called directly (the library path) refuses such a prompt too, rather than fusing caches
    # rotated with the short factors into a prompt the model would run with the long ones
    pre = a.prefill_kv(ids[:10])
    chunks = [ids[10:130], ids[130:250]]
    inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in chunks], chunks, ids[250:])
    with pytest.raises(ContextTooLongError, match="256-token"):
        fuse(a, inp, FusionConfig(method="full"))
    inp_short = FusionInput(pre, inp.chunks, chunks, ids[250:252])
    assert fuse(a, inp_short, FusionConfig(method="full")).num_tokens == 250  # 252 tokens: inside
