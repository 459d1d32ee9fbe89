"""DynamicCaches over tensors ragkv already holds: views, not copies, and the same answers as the copy."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.model.caches import dynamic_cache
from tests.conftest import make_model

IDS = list(range(5, 41))


def _copied(a, keys, values) -> DynamicCache:
    """The obvious slow path: transformers' own update, which concatenates (copies) every layer."""
    cache = DynamicCache(config=a.model.config)
    for i in range(keys.shape[0]):
        cache.update(keys[i : i + 1].clone(), values[i : i + 1].clone(), i)
    return cache


def _context(a, n: int = 24):
    kv = a.prefill_kv(IDS[:n])
    return kv.keys, kv.values, n


def test_the_layers_are_views_of_the_tensors_given(tiny_adapter):
    a = tiny_adapter
    keys, values, n = _context(a)
    cache = dynamic_cache(a.model.config, keys, values)
    assert cache.get_seq_length() == n
    for i, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == keys[i].data_ptr() and layer.values.data_ptr() == values[i].data_ptr()
        assert layer.keys.shape == (1, *keys.shape[1:])


def test_a_pass_on_it_equals_one_on_a_copy_and_leaves_the_tensors_alone(tiny_adapter):
    a = tiny_adapter
    keys, values, n = _context(a)
    before_k, before_v = keys.clone(), values.clone()
    want = a.forward(IDS[n:], _copied(a, keys, values), n)
    cache = dynamic_cache(a.model.config, keys, values)
    got = a.forward(IDS[n:], cache, n)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == len(IDS)
    assert torch.equal(keys, before_k) and torch.equal(values, before_v)  # appending copies, as always


def test_strided_views_of_a_larger_buffer(llama_adapter):
    """Fusion's buffer has free slots after the context: the cache holds a strided slice of it."""
    a = llama_adapter
    keys, values, n = _context(a)
    big_k = torch.zeros(keys.shape[0], keys.shape[1], n + 7, keys.shape[3])
    big_v = torch.zeros_like(big_k)
    big_k[:, :, :n], big_v[:, :, :n] = keys, values
    cache = dynamic_cache(a.model.config, big_k[:, :, :n], big_v[:, :, :n])
    assert not cache.layers[0].keys.is_contiguous()
    assert torch.equal(a.forward(IDS[n:], cache, n), a.forward(IDS[n:], _copied(a, keys, values), n))


def test_a_sliding_window_layer_is_filled_its_own_way(tiny_tokenizer):
    a = ModelAdapter(make_model("mistral", len(tiny_tokenizer), sliding_window=64), tiny_tokenizer, name="tiny-window")
    keys, values, n = _context(a)
    cache = dynamic_cache(a.model.config, keys, values)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    assert torch.equal(a.forward(IDS[n:], cache, n), a.forward(IDS[n:], _copied(a, keys, values), n))


def test_build_cache_does_not_alias_the_chunks(llama_adapter):
    a = llama_adapter
    kv = a.prefill_kv(IDS[:24])
    cache = a.build_cache([kv])
    assert cache.layers[0].keys.data_ptr() != kv.keys[0].data_ptr()
    cache.layers[0].keys.zero_()
    assert kv.keys.abs().sum() > 0


def test_a_fused_cache_is_the_fused_buffer_not_a_copy_of_it(llama_adapter):
    a = llama_adapter
    pre = a.prefill_kv(IDS[:4])
    chunks = [a.prefill_kv(IDS[4:14], past=[pre]), a.prefill_kv(IDS[14:24], past=[pre])]
    for ratio in (0.0, 0.5):  # nothing recomputed (the placed cache as is), and a recompute
        fused = fuse(a, FusionInput(pre, chunks, [IDS[4:14], IDS[14:24]], IDS[24:]), FusionConfig(ratio=ratio))
        storage = {layer.keys.untyped_storage().data_ptr() for layer in fused.cache.layers}
        assert len(storage) == 1  # every layer is a slice of one buffer: the fused one, not a copy
