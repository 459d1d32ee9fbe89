"""experiments/craft.py (Cache-Craft): the index-time recorder against a written-out prefill, the
contexts it records after, and the craft methods in fusion."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import ragkv.fusion
from ragkv import selection
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.selection import SelectionState
from tests.core.test_fusion import _prompt, _suffix_logits_from
from tests.core.test_model import _ids
from tests.core.test_selection import LENGTHS, _slow_sinks, _slow_top

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "craft.py"


@pytest.fixture(scope="module", autouse=True)
def craft() -> Iterator[ModuleType]:
    """The module loaded from its file (registering craft and craft_query), unregistered after."""
    spec = importlib.util.spec_from_file_location("craft", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    for name in ("craft", "craft_query"):
        selection._REGISTRY.pop(name, None)
    sys.modules.pop(spec.name, None)


def record_deviation(*args, **kwargs) -> torch.Tensor:
    return sys.modules["craft"].record_deviation(*args, **kwargs)


def _scores(adapter, inp: FusionInput, seed: int = 50) -> list[torch.Tensor]:
    """Each chunk's recorded deviation after two unrelated random contexts."""
    contexts = [_ids(11, seed), _ids(7, seed + 1)]
    return [
        record_deviation(adapter, inp.prefix, kv, ids, contexts)
        for kv, ids in zip(inp.chunks, inp.chunk_ids, strict=True)
    ]


def _with_scores(adapter, inp: FusionInput) -> FusionInput:
    return FusionInput(inp.prefix, inp.chunks, inp.chunk_ids, inp.suffix_ids, stored_scores=_scores(adapter, inp))


def test_recorded_deviation_is_zero_after_no_context(tiny_adapter):
    _, chunk_ids, _, inp = _prompt(tiny_adapter)
    kv, ids = inp.chunks[1], chunk_ids[1]
    assert torch.equal(record_deviation(tiny_adapter, inp.prefix, kv, ids, []), torch.zeros(len(ids)))
    # an empty context puts the chunk where it was cached: the real K/V are the cache (up to re-rotation)
    same = record_deviation(tiny_adapter, inp.prefix, kv, ids, [[]])
    assert same.dtype == torch.float32 and same.shape == (len(ids),)
    assert float(same.max()) < 1e-5
    moved = record_deviation(tiny_adapter, inp.prefix, kv, ids, [_ids(11, 50)])
    assert float(moved.min()) > 1e-4  # after other text every token drifts


def test_recorded_deviation_equals_the_written_out_prefill(llama_adapter):
    a = llama_adapter
    prefix, chunk_ids, _, inp = _prompt(a)
    kv, ids = inp.chunks[2], chunk_ids[2]
    contexts = [_ids(11, 50), _ids(7, 51)]
    want = torch.zeros(len(ids))
    for ctx in contexts:
        cache = a.build_cache([])
        a.forward(prefix + ctx + ids, cache, 0)
        start = len(prefix) + len(ctx)
        moved = a.rerotate(kv, start)
        per_layer = []
        for i in range(1, a.spec.num_layers):  # layer 0 is exact after re-rotation: left out
            real_k = cache.layers[i].keys[0, :, start:]  # [H, tokens, D]
            real_v = cache.layers[i].values[0, :, start:]
            dk = (real_k - moved.keys[i]).norm(dim=(0, 2)) / moved.keys[i].norm(dim=(0, 2))
            dv = (real_v - moved.values[i]).norm(dim=(0, 2)) / moved.values[i].norm(dim=(0, 2))
            per_layer.append((dk + dv) / 2)
        want += torch.stack(per_layer).mean(0) / len(contexts)
    got = record_deviation(a, inp.prefix, kv, ids, contexts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["craft", "craft_query"])
@pytest.mark.parametrize("first_chunk_exact", [True, False])
def test_craft_at_ratio_one_equals_full_prefill(llama_adapter, method, first_chunk_exact):
    a = llama_adapter
    prefix, chunk_ids, suffix, inp = _prompt(a)
    params = FusionConfig(method).strategy().Params(first_chunk_exact=first_chunk_exact)
    fused = fuse(a, _with_scores(a, inp), FusionConfig(method, 1.0, params), prefill_suffix=True)
    n = sum(map(len, chunk_ids))
    # the first chunk sits where it was cached (right after the prefix): exact, so not recomputed
    assert fused.recomputed_tokens == (n - len(chunk_ids[0]) if first_chunk_exact else n)
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(fused.suffix_logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["craft", "craft_query"])
def test_craft_at_ratio_zero_is_naive_reuse(tiny_adapter, method):
    _, _, _, inp = _prompt(tiny_adapter)
    naive = fuse(tiny_adapter, inp, FusionConfig("naive"), prefill_suffix=True)
    fused = fuse(tiny_adapter, _with_scores(tiny_adapter, inp), FusionConfig(method, 0.0), prefill_suffix=True)
    assert fused.recomputed_tokens == 0 and fused.selected.numel() == 0
    torch.testing.assert_close(fused.suffix_logits, naive.suffix_logits, atol=0, rtol=0)


def test_craft_recomputes_the_top_stored_tokens_exactly_as_the_slow_path(llama_adapter, craft):
    """The later chunks' sinks, then the highest stored scores, within the budget; the first chunk never.
    The suffix riding along the recomputed tokens equals prefilling it after (the layer loop is shared
    with every method and checked against the written-out one in test_fusion)."""
    a = llama_adapter
    _, chunk_ids, suffix, inp = _prompt(a, sizes=(30, 25, 35))
    scored = _with_scores(a, inp)
    cfg = FusionConfig("craft", 0.2, craft.CraftParams(sink_tokens=1))
    fused = fuse(a, scored, cfg)
    stored = torch.cat(list(scored.stored_scores or []))
    n, first = len(stored), len(chunk_ids[0])
    sinks = {first, first + len(chunk_ids[1])}  # the later chunks' first tokens
    order = sorted(range(first, n), key=lambda i: (i not in sinks, -float(stored[i])))
    want = sorted(order[: round(0.2 * n)])
    assert (fused.selected - inp.prefix.num_tokens).tolist() == want
    fast = fuse(a, scored, cfg, prefill_suffix=True)
    torch.testing.assert_close(fast.suffix_logits, _suffix_logits_from(a, fused, suffix), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["craft", "craft_query"])
def test_craft_refuses_to_run_without_stored_scores(tiny_adapter, method):
    _, _, _, inp = _prompt(tiny_adapter)
    with pytest.raises(ValueError, match="stored_scores=.*record_deviation"):
        fuse(tiny_adapter, inp, FusionConfig(method, 0.15))
    wrong = FusionInput(inp.prefix, inp.chunks, inp.chunk_ids, inp.suffix_ids, stored_scores=[torch.zeros(3)] * 3)
    with pytest.raises(ValueError, match="stored scores of shape"):
        fuse(tiny_adapter, wrong, FusionConfig(method, 0.15))


def test_craft_runs_no_question_probe_and_craft_query_runs_one(tiny_adapter, monkeypatch):
    _, _, _, inp = _prompt(tiny_adapter)
    scored = _with_scores(tiny_adapter, inp)
    calls: list[int] = []
    probe = ragkv.fusion._question_attention_steps

    def counted(*args, **kwargs):
        calls.append(1)
        return probe(*args, **kwargs)

    monkeypatch.setattr(ragkv.fusion, "_question_attention_steps", counted)
    fuse(tiny_adapter, scored, FusionConfig("craft", 0.3), prefill_suffix=True)
    assert calls == []
    fuse(tiny_adapter, scored, FusionConfig("craft_query", 0.3), prefill_suffix=True)
    assert calls == [1]


@pytest.mark.parametrize("method", ["query_focus"])
def test_an_exact_first_chunk_is_never_recomputed_and_full_recompute_stays_exact(llama_adapter, method):
    """``first_chunk_exact`` on the query-aware methods: the first chunk (cached right after this very
    prefix, uncompressed) is left alone at any ratio, and at ratio 1.0 the answer is still full
    prefill's; off (the default), the same ratio also recomputes the first chunk."""
    a = llama_adapter
    prefix, chunk_ids, suffix, inp = _prompt(a)
    n, first = sum(map(len, chunk_ids)), len(chunk_ids[0])
    exact = FusionConfig(method).strategy().Params(first_chunk_exact=True)
    fused = fuse(a, inp, FusionConfig(method, 1.0, exact), prefill_suffix=True)
    assert fused.recomputed_tokens == n - first
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(fused.suffix_logits, ref, atol=1e-4, rtol=1e-4)
    assert fuse(a, inp, FusionConfig(method, 1.0), prefill_suffix=True).recomputed_tokens == n
    part = fuse(a, inp, FusionConfig(method, 0.3, exact), prefill_suffix=True)
    assert part.selected.numel() > 0 and bool((part.selected >= len(prefix) + first).all())


PROMPTS = [
    {"chunks": ["a", "b", "c"]},
    {"chunks": ["b", "d", "e", "f"]},  # shares "b" with the first prompt
    {"chunks": ["g", "a"]},
]


def test_contexts_come_from_other_prompts_and_never_from_its_own_chunks(craft):
    for i, prompt in enumerate(PROMPTS):
        drawn = craft.craft_contexts(PROMPTS, i, k=2)
        assert len(drawn) == len(prompt["chunks"])
        others = {c for j, p in enumerate(PROMPTS) if j != i for c in p["chunks"]} - set(prompt["chunks"])
        for texts in drawn:
            assert len(texts) == 2 and len(set(texts)) == 2 and set(texts) <= others


def test_contexts_are_seeded_and_repeatable(craft):
    assert craft.craft_contexts(PROMPTS, 1, k=2) == craft.craft_contexts(PROMPTS, 1, k=2)
    assert [sorted(t) for t in craft.craft_contexts(PROMPTS, 0, k=9)] == [["d", "e", "f", "g"]] * 3  # "b" is its own
    assert craft.craft_contexts([{"chunks": ["x", "y"]}], 0) == [[], []]  # no other prompt: nothing to draw


def test_craft_picks_the_later_chunks_sinks_then_the_top_stored_scores(craft):
    state = SelectionState.start(LENGTHS)
    state.stored_scores = torch.rand(25, generator=torch.Generator().manual_seed(7))
    first = LENGTHS[0]
    later = [i for i in range(25) if i >= first]
    masked = [float(state.stored_scores[i]) if i >= first else float("-inf") for i in range(25)]
    sinks = set(_slow_sinks(LENGTHS, 2)) - set(range(first))
    top = FusionConfig("craft", 0.4).strategy()
    assert top.initial(state).tolist() == _slow_top(masked, round(0.4 * 25), sinks)
    assert top.check_layers(state, 4) == () and not top.wants_query_attention
    assert FusionConfig("craft", 1.0).strategy().initial(state).tolist() == later  # the first chunk is exact
    every = FusionConfig("craft", 0.4, craft.CraftParams(first_chunk_exact=False)).strategy()
    want = _slow_top(state.stored_scores.tolist(), round(0.4 * 25), set(_slow_sinks(LENGTHS, 2)))
    assert every.initial(state).tolist() == want
    assert FusionConfig("craft", 0.0).strategy().initial(state).numel() == 0  # budget 0: naive
    one = SelectionState.start([9])
    one.stored_scores = torch.rand(9)
    assert FusionConfig("craft", 0.5).strategy().initial(one).numel() == 0  # one chunk: all of it exact


def test_craft_query_weights_the_stored_score_by_later_attention(craft):
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(8)
    state.stored_scores = torch.rand(25, generator=g)
    strategy = FusionConfig("craft_query", 0.3, craft.CraftQueryParams(query_weight=2.0)).strategy()
    assert strategy.score(state).tolist() == state.stored_scores.tolist()  # no question: craft's score
    state.query_attention = torch.rand(4, 25, generator=g)
    imp = state.query_attention[2:].sum(0)  # layers after check layer 1
    want = state.stored_scores / state.stored_scores.mean() * (imp / imp.mean() + 1e-3) ** 2.0
    torch.testing.assert_close(strategy.score(state), want)
    masked = [float(want[i]) if i >= LENGTHS[0] else float("-inf") for i in range(25)]
    sinks = set(_slow_sinks(LENGTHS, 2)) - set(range(LENGTHS[0]))
    assert strategy.initial(state).tolist() == _slow_top(masked, round(0.3 * 25), sinks)
    assert strategy.wants_query_attention and strategy.wants_stored_scores


def test_craft_methods_say_how_to_pass_the_stored_scores(craft):
    state = SelectionState.start(LENGTHS)
    for name in ("craft", "craft_query"):
        with pytest.raises(ValueError, match=f"{name}.*record_deviation"):
            FusionConfig(name, 0.2).strategy().initial(state)
    state.stored_scores = torch.zeros(24)
    with pytest.raises(ValueError, match="expected \\(25,\\)"):
        FusionConfig("craft", 0.2).strategy().initial(state)
    with pytest.raises(ValueError, match="sink_tokens"):
        craft.CraftQueryParams(sink_tokens=-1)
