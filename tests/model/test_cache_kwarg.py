"""The Cache goes to transformers by the keyword the installed version takes: no FutureWarning per forward."""

from __future__ import annotations

import warnings

import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model.caches import cache_kwarg


def test_forward_and_layer_runs_warn_nothing(llama_adapter):
    a = llama_adapter
    ids = list(range(5, 30))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        pre = a.prefill_kv(ids[:4])
        chunks = [a.prefill_kv(ids[4:12], past=[pre]), a.prefill_kv(ids[12:20], past=[pre])]
        fused = fuse(a, FusionInput(pre, chunks, [ids[4:12], ids[12:20]], ids[20:]), FusionConfig(ratio=0.5))
        logits = a.forward(ids[20:], fused.cache, fused.num_tokens)
    assert torch.isfinite(logits).all()


def test_the_keyword_follows_the_signature():
    class New:
        def forward(self, x, cache=None): ...

    class Old:
        def forward(self, x, past_key_values=None): ...

    assert cache_kwarg(New) == "cache" and cache_kwarg(Old) == "past_key_values"
