"""The masks fusion hands attention: one per set of active tokens, shared by every layer.

A float ``[queries, keys]`` mask per layer would cost a long context its memory bandwidth; these
tests record what each layer's attention receives (through transformers' attention registry, the
seam the model calls, and ragkv's own SDPA call) and check its identity, dtype and layout.
Exactness against full prefill and the slow loop lives in test_fusion.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ragkv.fusion import FusionConfig, fuse
from ragkv.model import ModelAdapter
from ragkv.model import attention as attention_module
from ragkv.model.attention import PLAIN
from ragkv.selection import BlendParams
from tests.conftest import make_model
from tests.core.test_fusion import _prompt


@contextmanager
def recorded_masks(seams: list[str] | None = None) -> Iterator[list[Any]]:
    """Within the block, the mask of every SDPA call a layer makes, in order: through transformers'
    SDPA function (the registry's, which ragkv's dispatcher delegates to) or ragkv's own SDPA call
    (where grouped query heads share their key heads); ``seams`` gets "registry" or "own" for each."""
    masks: list[Any] = []
    seams = [] if seams is None else seams
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, *a, **kw):
        masks.append(mask)
        seams.append("registry")
        return sdpa(module, query, key, value, mask, *a, **kw)

    def own(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        masks.append(kw.get("attn_mask"))
        seams.append("own")
        return torch_sdpa(query, key, value, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recording)
        mp.setattr(attention_module, "F", SimpleNamespace(scaled_dot_product_attention=own))
        yield masks


def _long_prompt(adapter: ModelAdapter):
    return _prompt(adapter, sizes=(300, 250, 333))  # ~900 context slots


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["grouped", "one-per-head"])
def test_a_selective_pass_builds_one_mask_per_active_set_not_one_per_layer(tiny_tokenizer, monkeypatch, kv_heads):
    """Grouped heads take ragkv's own SDPA call, one KV head per query head transformers' SDPA
    function: either way every layer of an active set gets the same mask."""
    a = ModelAdapter(make_model("llama", len(tiny_tokenizer), num_key_value_heads=kv_heads), tiny_tokenizer)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)  # torch's attention, as on a GPU
    *_, inp = _long_prompt(a)
    config = FusionConfig(method="blend", ratio=0.15, params=BlendParams(check_layer=1))
    seams: list[str] = []
    with recorded_masks(seams) as masks:
        fused = fuse(a, inp, config)
    assert set(seams) == {"own" if kv_heads == 2 else "registry"}
    # the last layer's chunk rows write their K/V alone (no suffix rides along): no attention there
    assert len(masks) == a.spec.num_layers - 1
    # every chunk token through layers 0-1, then the selected 15%: two masks for three layers
    assert len({m.untyped_storage().data_ptr() for m in masks}) == 2
    for mask in masks:
        assert mask.dtype == a.dtype and mask.shape[:2] == (1, 1) and mask.shape[-1] == fused.num_tokens
        # rows padded to 16 elements: SDPA's memory-efficient CUDA kernel takes it without a copy
        assert mask.stride(-1) == 1 and all(s % 16 == 0 for s in mask.stride()[:-1])
    assert masks[-1].shape[2] == fused.recomputed_tokens


def test_the_mask_is_exact_causal_over_the_slots(llama_adapter):
    pos = torch.tensor([3, 4, 9, 12])
    mask = llama_adapter.causal_mask(pos, 13, torch.float32)[0, 0]  # [4, 13]
    allowed = torch.arange(13).unsqueeze(0) <= pos.unsqueeze(1)
    assert torch.equal(mask == 0, allowed) and bool((mask[~allowed] == torch.finfo(torch.float32).min).all())


def test_queries_at_the_tail_get_a_causal_bias_and_stay_exact(llama_adapter, monkeypatch):
    """What CUDA runs (no mask tensor at all), forced here on the CPU, where torch materialises it."""
    a = llama_adapter
    prefix, chunk_ids, suffix, inp = _prompt(a)
    monkeypatch.setattr(a, "_lower_right_bias_is_free", lambda: True)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)  # torch's attention, as on a GPU
    with recorded_masks() as masks, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: no CUDA kernel for the bias on the CPU
        fused = fuse(a, inp, FusionConfig(method="full", ratio=1.0), prefill_suffix=True)
    assert len(masks) == a.spec.num_layers and all(isinstance(m, CausalBias) for m in masks)
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    assert fused.suffix_logits is not None
    torch.testing.assert_close(fused.suffix_logits, ref, atol=1e-4, rtol=1e-4)


def test_the_question_probe_reads_a_causal_bias_as_lower_right(llama_adapter, monkeypatch):
    """The probe's own eager attention takes the bias the way SDPA does: the same question weights."""
    a = llama_adapter
    *_, inp = _prompt(a)
    config = FusionConfig(method="query_focus", ratio=0.3)
    want = fuse(a, inp, config).selected
    monkeypatch.setattr(a, "_lower_right_bias_is_free", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = fuse(a, inp, config).selected
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probes_bias_made_once_gives_the_probabilities_of_the_bias_made_per_layer(dtype):
    """On CUDA the probe's mask is the lower-right bias, which its eager attention made in every layer
    (4 kernels); fusion now makes it once, as the scores' additive fp32 mask: the same output and
    weights, bit for bit."""
    from torch.nn.attention.bias import causal_lower_right

    from ragkv.model.attention import AttentionProbe, _probe_attention
    from ragkv.model.masks import causal_mask_at

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 7, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 50, 16, generator=g).to(dtype) for _ in range(2))
    per_layer, once = AttentionProbe(None), AttentionProbe(None)
    want, _ = _probe_attention(per_layer, 0, q, k, v, causal_lower_right(7, 50), 0.25)
    mask = causal_mask_at(torch.arange(43, 50), 50, torch.float32, torch.device("cpu"))
    got, _ = _probe_attention(once, 0, q, k, v, mask, 0.25)
    assert torch.equal(got, want) and torch.equal(once.weights[0], per_layer.weights[0])


def test_the_probe_on_a_gpus_bias_gets_one_mask_for_every_layer(llama_adapter, monkeypatch):
    import ragkv.model.attention as attention

    a = llama_adapter
    *_, inp = _prompt(a)
    seen: list[Any] = []
    probe_attention = attention._probe_attention

    def recording(probe, layer, query, key, value, mask, scaling):
        seen.append(mask)
        return probe_attention(probe, layer, query, key, value, mask, scaling)

    monkeypatch.setattr(attention, "_probe_attention", recording)
    monkeypatch.setattr(a, "_lower_right_bias_is_free", lambda: True)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fuse(a, inp, FusionConfig(method="query_focus", ratio=0.3))
    assert len(seen) == a.spec.num_layers and len({id(m) for m in seen}) == 1
    assert isinstance(seen[0], torch.Tensor) and not isinstance(seen[0], CausalBias)
    assert seen[0].dtype == torch.float32
