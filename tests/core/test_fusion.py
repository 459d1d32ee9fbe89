"""Fusion exactness: 100% = full prefill, 0% = naive reuse, a subset = the slow obvious loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ragkv.fusion import FusionConfig, FusionInput, _question_attention, fuse
from ragkv.model import ModelAdapter
from ragkv.selection import QueryFocusParams, SelectionState, available_strategies, strategy_class
from tests.core.test_model import _ids


def _config(method: str, ratio: float, **knobs) -> FusionConfig:
    """``method`` at ``ratio``, with those of ``knobs`` that its parameter record has."""
    record = strategy_class(method).Params
    names = {f.name for f in dataclasses.fields(record)}
    return FusionConfig(method, ratio, record(**{k: v for k, v in knobs.items() if k in names}))


def _prompt(adapter: ModelAdapter, sizes=(20, 17, 23), seed: int = 0):
    prefix = _ids(9, seed)
    chunk_ids = [_ids(n, seed + 10 + i) for i, n in enumerate(sizes)]
    suffix = _ids(5, seed + 99)
    pre = adapter.prefill_kv(prefix)
    chunks = [adapter.prefill_kv(c, past=[pre]) for c in chunk_ids]  # each alone after the prefix
    return prefix, chunk_ids, suffix, FusionInput(pre, chunks, chunk_ids, suffix)


def _suffix_logits_from(adapter, fused, suffix):
    return adapter.forward(suffix, fused.cache, fused.num_tokens)


def test_full_recompute_equals_full_prefill(tiny_adapter):
    prefix, chunk_ids, suffix, inp = _prompt(tiny_adapter)
    fused = fuse(tiny_adapter, inp, FusionConfig(method="full"))
    assert fused.recomputed_tokens == sum(map(len, chunk_ids))
    ref = tiny_adapter.forward(prefix + sum(chunk_ids, []) + suffix, tiny_adapter.build_cache([]), 0)
    torch.testing.assert_close(
        _suffix_logits_from(tiny_adapter, fused, suffix), ref[-len(suffix) :], atol=1e-4, rtol=1e-4
    )


def test_zero_recompute_equals_naive_reuse(tiny_adapter):
    _, chunk_ids, suffix, inp = _prompt(tiny_adapter)
    for cfg in (FusionConfig(method="naive"), FusionConfig(method="blend", ratio=0.0)):
        fused = fuse(tiny_adapter, inp, cfg)
        assert fused.recomputed_tokens == 0
        offset, placed = inp.prefix.num_tokens, [inp.prefix]
        for kv in inp.chunks:
            placed.append(tiny_adapter.rerotate(kv, offset))
            offset += kv.num_tokens
        naive = tiny_adapter.suffix_logits(placed, suffix)
        torch.testing.assert_close(_suffix_logits_from(tiny_adapter, fused, suffix), naive, atol=1e-4, rtol=1e-4)


def _slow_layer(layer, hidden, pos, keys, values, cos_sin, weights=None):
    """One Llama decoder layer for the tokens at ``pos``, written out: project, rotate, write K/V at
    their slots, then attend one query at a time over keys at slots <= its position. ``weights``
    (``[keys]``), when given, accumulates the attention probabilities over heads and queries."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)  # [1, q, d]
    q = attn.q_proj(x).view(1, len(pos), -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, len(pos), -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, len(pos), -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *cos_sin)
    keys[:, :, pos], values[:, :, pos] = k, v
    groups = q.shape[1] // keys.shape[1]
    out = torch.zeros_like(q)
    for j, p in enumerate(pos.tolist()):
        kk = keys[0, :, : p + 1].repeat_interleave(groups, 0)  # [Hq, p+1, D]
        vv = values[0, :, : p + 1].repeat_interleave(groups, 0)
        w = torch.softmax((q[0, :, j : j + 1] @ kk.transpose(1, 2)) * attn.scaling, dim=-1)
        out[0, :, j] = (w @ vv)[:, 0]
        if weights is not None:
            weights[: p + 1] += w.sum(dim=(0, 1))
    h = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, len(pos), -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _naive_kv(a, inp):
    """Per-layer K/V tensors ``[1, H, N, D]`` of the naively placed cache (chunks re-rotated in turn)."""
    placed, offset = [inp.prefix], inp.prefix.num_tokens
    for kv in inp.chunks:
        placed.append(a.rerotate(kv, offset))
        offset += kv.num_tokens
    ref = a.build_cache(placed)
    return [layer.keys.clone() for layer in ref.layers], [layer.values.clone() for layer in ref.layers]


def _slow_question_attention(a, inp, slots):
    """The question run layer by layer on the naive cache, attention written out: ``[layers, chunk tokens]``."""
    keys, values = _naive_kv(a, inp)
    n, s = keys[0].shape[2], len(inp.suffix_ids)
    pos = torch.arange(n, n + s)
    pad = torch.zeros(1, keys[0].shape[1], s, keys[0].shape[3])
    keys, values = [torch.cat([k, pad], 2) for k in keys], [torch.cat([v, pad], 2) for v in values]
    hidden = a.embed(torch.tensor(list(inp.suffix_ids)))
    rows = []
    with torch.no_grad():
        for i, layer in enumerate(a.model.model.layers):
            w = torch.zeros(n + s)
            hidden = _slow_layer(layer, hidden, pos, keys[i], values[i], a.position_embeddings(pos, hidden), w)
            rows.append(w[slots] / w[slots].sum())
    return torch.stack(rows)


def test_the_question_probe_records_the_attention_the_question_pays(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    n_chunk = sum(len(c) for c in inp.chunk_ids)
    slots = torch.arange(inp.prefix.num_tokens, inp.prefix.num_tokens + n_chunk)
    keys, values = _naive_kv(a, inp)
    s = len(inp.suffix_ids)
    pad = torch.zeros(a.spec.num_layers, keys[0].shape[1], s, keys[0].shape[3])
    k = torch.cat([torch.cat(keys), pad], 2)
    v = torch.cat([torch.cat(values), pad], 2)
    got = _question_attention(a, k, v, torch.tensor(list(inp.suffix_ids)), int(slots[-1]) + 1, slots)
    torch.testing.assert_close(got, _slow_question_attention(a, inp, slots), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["full", "blend", "query_focus", "query_focus+numbers", "query_focus+coverage"])
def test_selective_recompute_equals_slow_loop(llama_adapter, method):
    a = llama_adapter
    _, chunk_ids, suffix, inp = _prompt(a)
    numbers = method.endswith("+numbers")  # whole numbers recomputed, their tokens weighed up
    coverage = 0.5 if method.endswith("+coverage") else 0.0  # the share set by the last check's scores
    method = method.removesuffix("+numbers").removesuffix("+coverage")
    cfg = _config(
        method,
        0.3,
        narrow_layer=2,
        focus_ratio=0.6,
        number_spans=numbers,
        number_boost=3.0 if numbers else 1.0,
        coverage=coverage,
        min_ratio=0.02,
    )
    fused = fuse(a, inp, cfg)
    # the slow path replays the same selection decisions layer by layer with explicit attention
    slots = torch.arange(inp.prefix.num_tokens, fused.num_tokens)
    keys, values = _naive_kv(a, inp)
    strategy, state = cfg.strategy(), SelectionState.start([len(c) for c in chunk_ids])
    if strategy.wants_query_attention:
        state.query_attention = _slow_question_attention(a, inp, slots)
    if numbers:
        state.number_runs = a.number_runs(torch.tensor(sum(chunk_ids, [])))
        assert (state.number_runs >= 0).any()  # the random prompt holds numbers to complete
    active = strategy.initial(state)
    checks = set(strategy.check_layers(state, a.spec.num_layers))
    state.checks = tuple(sorted(checks))
    hidden = a.embed(torch.tensor(sum(chunk_ids, []))[active])
    with torch.no_grad():
        for i, layer in enumerate(a.model.model.layers):
            pos = slots[active]
            old_k, old_v = keys[i][:, :, pos].clone(), values[i][:, :, pos].clone()
            hidden = _slow_layer(layer, hidden, pos, keys[i], values[i], a.position_embeddings(pos, hidden))
            if i in checks:
                dk = ((keys[i][:, :, pos] - old_k).pow(2).sum((0, 1, 3)) / old_k.pow(2).sum((0, 1, 3))).sqrt()
                dv = ((values[i][:, :, pos] - old_v).pow(2).sum((0, 1, 3)) / old_v.pow(2).sum((0, 1, 3))).sqrt()
                strategy.observe(state, i, active, dk, dv)
                keep = strategy.select(state, i)
                active, hidden = active[keep], hidden[:, keep]
    assert fused.recomputed_tokens == active.numel()
    assert torch.equal(fused.selected, slots[active])
    assert (fused.wanted_share, fused.selection_capped) == (state.wanted_share, state.capped)
    if coverage:  # the target set the share: neither the cap nor the floor
        assert fused.wanted_share is not None and 0.02 * 60 < active.numel() < 0.3 * 60
    for i, layer in enumerate(fused.cache.layers):
        torch.testing.assert_close(layer.keys, keys[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, values[i], atol=1e-4, rtol=1e-4)


def test_a_coverage_the_cap_cannot_meet_recomputes_the_cap_and_says_so(llama_adapter):
    _, chunk_ids, _, inp = _prompt(llama_adapter)
    n = sum(map(len, chunk_ids))
    capped = fuse(llama_adapter, inp, _config("query_focus", 0.3, coverage=1.0), prefill_suffix=True)
    assert capped.recomputed_tokens == round(0.3 * n) and capped.selection_capped
    assert capped.wanted_share is not None and capped.wanted_share > 0.3
    met = fuse(llama_adapter, inp, _config("query_focus", 0.3, coverage=0.2), prefill_suffix=True)
    assert not met.selection_capped and met.wanted_share is not None and met.wanted_share <= 0.3
    assert round(0.05 * n) <= met.recomputed_tokens < round(0.3 * n)
    fixed = fuse(llama_adapter, inp, _config("query_focus", 0.3), prefill_suffix=True)
    assert fixed.wanted_share is None and not fixed.selection_capped  # no target: nothing to report


def test_query_aware_selection_runs_and_respects_budget(tiny_adapter):
    _, chunk_ids, suffix, inp = _prompt(tiny_adapter)
    n = sum(map(len, chunk_ids))
    fused = fuse(tiny_adapter, inp, FusionConfig(method="query_focus", ratio=0.25))
    assert fused.recomputed_tokens == round(0.25 * n)
    starts = [0, 20, 37]  # sinks forced in
    sel = (fused.selected - inp.prefix.num_tokens).tolist()
    assert all(s in sel and s + 1 in sel for s in starts)


def test_recompute_reduces_error_vs_naive(llama_adapter):
    prefix, chunk_ids, suffix, inp = _prompt(llama_adapter, sizes=(40, 40, 40))
    full = llama_adapter.forward(prefix + sum(chunk_ids, []) + suffix, llama_adapter.build_cache([]), 0)
    ref = torch.log_softmax(full[-len(suffix) :], -1)

    def kl(method, ratio):
        fused = fuse(llama_adapter, inp, FusionConfig(method=method, ratio=ratio))
        got = torch.log_softmax(_suffix_logits_from(llama_adapter, fused, suffix), -1)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    assert kl("blend", 0.5) < kl("naive", 0.0)
    assert kl("blend", 1.0) < 1e-6


def test_unknown_method_lists_choices():
    with pytest.raises(ValueError, match="blend"):
        strategy_class("nope")
    assert {"naive", "full", "blend", "query_focus"} <= set(available_strategies())
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig(ratio=1.5)


@pytest.mark.parametrize("method", ["naive", "query_focus"])
def test_uncached_segments_are_computed_in_place(llama_adapter, method):
    """Segments with no cache (placeholder zeros) are recomputed through every layer: if every
    segment is uncached, any method gives full prefill exactly."""
    a = llama_adapter
    prefix, chunk_ids, suffix, inp = _prompt(a)
    zeros = [a.empty_kv(len(c)) for c in chunk_ids]
    forced = FusionInput(inp.prefix, zeros, chunk_ids, suffix, forced=[True] * len(chunk_ids))
    fused = fuse(a, forced, FusionConfig(method=method, ratio=0.2))
    assert fused.forced_tokens == sum(map(len, chunk_ids)) and fused.recomputed_tokens == 0
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(_suffix_logits_from(a, fused, suffix), ref, atol=1e-4, rtol=1e-4)
    # one uncached segment among cached ones: its tokens are always recomputed, on top of the budget
    mixed = FusionInput(
        inp.prefix, [inp.chunks[0], zeros[1], inp.chunks[2]], chunk_ids, suffix, forced=[False, True, False]
    )
    fused = fuse(a, mixed, FusionConfig(method=method, ratio=0.2))
    sel = set((fused.selected - inp.prefix.num_tokens).tolist())
    assert set(range(20, 37)) <= sel and fused.forced_tokens == 17


def test_query_scores_weight_deviation_by_later_layer_attention():
    params = QueryFocusParams(sink_tokens=0, narrow_factor=1.0)  # the first check keeps ratio
    query = FusionConfig(method="query_focus", ratio=0.5, params=params).strategy()
    blend = FusionConfig(method="blend", ratio=0.5).strategy()
    state = SelectionState.start([4])  # one 4-token chunk
    state.query_attention = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # layer 0 (before the check: ignored)
            [0.0, 0.0, 1.0, 1.0],  # layer 1 = check layer
            [0.0, 0.0, 0.5, 0.5],  # later layers: the question reads 2, 3
            [0.0, 0.1, 0.4, 0.5],
        ]
    )
    query.observe(state, 1, torch.arange(4), k_dev=torch.zeros(4), v_dev=torch.tensor([4.0, 3.0, 2.0, 1.0]))
    # plain deviation would keep tokens 0 and 1; weighted by the question's attention: 2 and 3
    assert blend.select(state, 1).tolist() == [0, 1]
    assert query.select(state, 1).tolist() == [2, 3]


@pytest.mark.parametrize("method", ["naive", "full", "blend", "query_focus"])
def test_prefilling_the_suffix_inside_fusion_equals_prefilling_it_after(llama_adapter, method):
    """The fast path (suffix riding along the recomputed tokens) equals fusing, then prefilling."""
    a = llama_adapter
    _, chunk_ids, suffix, inp = _prompt(a, sizes=(30, 25, 35))
    cfg = _config(method, 0.2, narrow_layer=2)
    slow = fuse(a, inp, cfg)
    slow_logits = _suffix_logits_from(a, slow, suffix)
    fast = fuse(a, inp, cfg, prefill_suffix=True)
    assert fast.suffix_logits is not None
    torch.testing.assert_close(fast.suffix_logits, slow_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast.selected, slow.selected) and fast.recomputed_tokens == slow.recomputed_tokens
    assert fast.num_tokens == slow.num_tokens and fast.cache.get_seq_length() == slow.num_tokens + len(suffix)
    for got, want in zip(fast.cache.layers, slow.cache.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_query_focus_runs_only_its_focus_set_through_the_check_layer(tiny_adapter, monkeypatch):
    _, chunk_ids, suffix, inp = _prompt(tiny_adapter)
    n = sum(map(len, chunk_ids))
    seen: dict[int, int] = {}
    cls = strategy_class("query_focus")
    select = cls.select

    def spy(self, state, layer):
        seen[layer] = int(state.active[layer].numel())
        return select(self, state, layer)

    monkeypatch.setattr(cls, "select", spy)
    cfg = FusionConfig("query_focus", 0.1, QueryFocusParams(focus_ratio=0.5, narrow_layer=1, check_layer=0))
    fused = fuse(tiny_adapter, inp, cfg)
    assert seen[0] == round(0.5 * n)  # the focus set, not every chunk token, ran the first check
    assert fused.recomputed_tokens == round(0.1 * n)


@pytest.mark.parametrize("method", ["blend", "query_focus"])
def test_a_zero_budget_is_naive_reuse_for_every_selecting_method(tiny_adapter, method):
    _, _, suffix, inp = _prompt(tiny_adapter)
    naive = fuse(tiny_adapter, inp, FusionConfig(method="naive"), prefill_suffix=True)
    fused = fuse(tiny_adapter, inp, FusionConfig(method=method, ratio=0.0), prefill_suffix=True)
    assert fused.recomputed_tokens == 0 and fused.selected.numel() == 0
    torch.testing.assert_close(fused.suffix_logits, naive.suffix_logits, atol=0, rtol=0)


def test_the_question_probe_leaves_the_context_untouched(llama_adapter):
    a = llama_adapter
    _, _, _, inp = _prompt(a)
    keys, values = _naive_kv(a, inp)
    s, n = len(inp.suffix_ids), keys[0].shape[2]
    pad = torch.zeros(a.spec.num_layers, keys[0].shape[1], s, keys[0].shape[3])
    k, v = torch.cat([torch.cat(keys), pad], 2), torch.cat([torch.cat(values), pad], 2)
    before_k, before_v = k[:, :, :n].clone(), v[:, :, :n].clone()
    _question_attention(a, k, v, torch.tensor(list(inp.suffix_ids)), n, torch.arange(9, n))
    assert torch.equal(k[:, :, :n], before_k) and torch.equal(v[:, :, :n], before_v)


@pytest.mark.parametrize("narrow_layer", [2, 3])  # 3: the last check is the last layer
def test_rows_that_only_write_kv_fuse_as_whole_layers_do(tiny_adapter, monkeypatch, narrow_layer):
    """The rows a check drops and the chunk rows of the last layer write their K/V alone
    (ModelAdapter.write_layer_kv): the same cache, selection and logits as running every row whole."""
    a = tiny_adapter
    _, _, suffix, inp = _prompt(a)
    cfg = _config("query_focus", 0.3, narrow_layer=narrow_layer, focus_ratio=0.6)
    assert a.writes_layer_kv  # every tiny family's layers run in parts
    trimmed = fuse(a, inp, cfg, prefill_suffix=True)
    last = fuse(a, inp, cfg, prefill_suffix=True, logits="last")
    monkeypatch.setattr(ModelAdapter, "writes_layer_kv", property(lambda self: False))
    whole = fuse(a, inp, cfg, prefill_suffix=True)
    assert torch.equal(trimmed.selected, whole.selected) and trimmed.recomputed_tokens == whole.recomputed_tokens
    assert trimmed.token_passes < whole.token_passes  # the dropped rows and the last layer's chunk rows
    for got, want in zip(trimmed.cache.layers, whole.cache.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
    assert trimmed.suffix_logits is not None and whole.suffix_logits is not None and last.suffix_logits is not None
    assert trimmed.suffix_logits.shape == (len(suffix), a.spec.vocab_size) and last.suffix_logits.shape[0] == 1
    torch.testing.assert_close(trimmed.suffix_logits, whole.suffix_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.suffix_logits[0], trimmed.suffix_logits[-1], atol=1e-5, rtol=1e-5)
    without_tail = fuse(a, inp, cfg)  # no suffix riding along: the last layer runs no row whole
    for got, want in zip(without_tail.cache.layers, whole.cache.layers, strict=True):
        n = without_tail.num_tokens
        torch.testing.assert_close(got.keys[:, :, :n], want.keys[:, :, :n], atol=1e-5, rtol=1e-5)


def test_suffix_logits_of_another_kind_are_refused(llama_adapter):
    *_, inp = _prompt(llama_adapter)
    with pytest.raises(ValueError, match="logits must be 'all'"):
        fuse(llama_adapter, inp, FusionConfig(), prefill_suffix=True, logits="none")  # type: ignore[arg-type]
