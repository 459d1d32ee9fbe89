"""Selection strategies without a model: parameter records, the state, and each selection against
the obvious written-out rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragkv.fusion import FusionConfig
from ragkv.selection import (
    BlendParams,
    BudgetParams,
    CraftParams,
    CraftQueryParams,
    GradualParams,
    NoParams,
    QueryFocusParams,
    QueryGradualParams,
    QueryParams,
    SelectionState,
    SinkParams,
    available_strategies,
    strategy_class,
)

LENGTHS = [7, 1, 12, 5]  # chunk lengths: 25 chunk tokens, one chunk shorter than its sinks


def _slow_sinks(lengths: list[int], sink_tokens: int) -> list[int]:
    out, start = [], 0
    for n in lengths:
        out += list(range(start, start + min(n, sink_tokens)))
        start += n
    return out


def _slow_top(score: list[float], k: int, forced: set[int]) -> list[int]:
    """The ``k`` best by (forced first, then higher score), as sorted indices."""
    order = sorted(range(len(score)), key=lambda i: (i not in forced, -score[i]))
    return sorted(order[:k])


def _measured(strategy, state: SelectionState, layer: int, k_dev: torch.Tensor, v_dev: torch.Tensor) -> None:
    strategy.observe(state, layer, torch.arange(state.num_chunk_tokens), k_dev=k_dev, v_dev=v_dev)


def test_every_method_takes_its_own_record_and_refuses_another():
    for name in available_strategies():
        record = strategy_class(name).Params
        assert FusionConfig(name, 0.2).strategy().params == record()  # None: the method's defaults
        assert FusionConfig(name, 0.2, record()).strategy().params == record()
    with pytest.raises(TypeError, match="'blend' takes BlendParams"):
        FusionConfig("blend", 0.2, SinkParams())
    with pytest.raises(TypeError, match="takes BlendSinkParams, got QueryParams"):  # a sub-record is refused too
        FusionConfig("blend_sink", 0.2, QueryParams())
    with pytest.raises(TypeError, match="NoParams"):
        FusionConfig("naive", 0.0, BlendParams())


def test_config_keeps_method_and_ratio_and_switches_method_freely():
    cfg = FusionConfig(method="query_focus", ratio=0.15)
    assert cfg.strategy().ratio == 0.15 and isinstance(cfg.strategy().params, QueryFocusParams)
    assert isinstance(dataclasses.replace(cfg, method="budget").strategy().params, BudgetParams)
    with pytest.raises(ValueError, match="unknown fusion method 'nope'"):
        FusionConfig(method="nope")
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig(ratio=-0.1)


def test_combined_records_carry_and_check_both_parents_knobs():
    p = QueryGradualParams(narrow_layer=3, query_weight=2.0, sink_tokens=1, deviation="kv")
    assert (p.narrow_layer, p.query_weight, p.sink_tokens, p.deviation, p.check_layer) == (3, 2.0, 1, "kv", 1)
    for bad in ({"sink_tokens": -1}, {"check_layer": -1}, {"deviation": "q"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QueryFocusParams(**bad)
    with pytest.raises(TypeError):
        BlendParams(1)  # keyword-only: no positional knob can land in the wrong field
    assert NoParams() == NoParams()


def test_state_layout_and_sink_mask_match_the_chunk_lengths():
    state = SelectionState.start(LENGTHS)
    assert state.num_chunk_tokens == 25 and state.chunk_starts.tolist() == [0, 7, 8, 20]
    every = torch.arange(25)
    for sinks in (0, 1, 2, 6):
        assert every[state.sink_mask(every, sinks)].tolist() == _slow_sinks(LENGTHS, sinks)
    subset = torch.tensor([1, 7, 9, 20, 24])
    assert state.sink_mask(subset, 2).tolist() == [True, True, True, True, False]
    assert [state.budget(s) for s in (0.0, 0.1, 0.5, 1.0, 2.0)] == [0, 2, 12, 25, 25]
    assert SelectionState.start([]).num_chunk_tokens == 0


@pytest.mark.parametrize("deviation", ["k", "v", "kv"])
@pytest.mark.parametrize("method", ["blend", "blend_sink"])
def test_blend_keeps_the_top_ratio_by_deviation(method, deviation):
    strategy = FusionConfig(method, 0.3, strategy_class(method).Params(deviation=deviation)).strategy()
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(1)
    k_dev, v_dev = torch.rand(25, generator=g), torch.rand(25, generator=g)
    _measured(strategy, state, 1, k_dev, v_dev)
    score = {"k": k_dev, "v": v_dev, "kv": k_dev + v_dev}[deviation]
    forced = set(_slow_sinks(LENGTHS, 2)) if method == "blend_sink" else set()
    assert strategy.select(state, 1).tolist() == _slow_top(score.tolist(), round(0.3 * 25), forced)
    assert strategy.check_layers(state, 4) == (1,) and strategy.check_layers(state, 1) == (0,)


def test_gradual_cuts_wide_then_narrows_at_a_deeper_layer():
    strategy = FusionConfig("gradual", 0.2, GradualParams(narrow_factor=2.5)).strategy()
    state = SelectionState.start(LENGTHS)
    assert strategy.check_layers(state, 16) == (1, 4)  # narrow_layer 0: num_layers // 4
    assert FusionConfig("gradual", 0.2, GradualParams(narrow_layer=9)).strategy().check_layers(state, 16) == (1, 9)
    assert strategy.check_layers(state, 2) == (1,)  # no deeper layer left
    v = torch.rand(25, generator=torch.Generator().manual_seed(2))
    _measured(strategy, state, 1, torch.zeros(25), v)
    first = strategy.select(state, 1)
    assert first.tolist() == _slow_top(v.tolist(), round(0.2 * 2.5 * 25), set())
    v2 = torch.rand(first.numel(), generator=torch.Generator().manual_seed(3))
    strategy.observe(state, 4, first, k_dev=torch.zeros(first.numel()), v_dev=v2)
    assert strategy.select(state, 4).tolist() == _slow_top(v2.tolist(), round(0.2 * 25), set())


def test_budget_recomputes_what_deviates_past_the_bound_up_to_max_ratio():
    strategy = FusionConfig("budget", 0.0, BudgetParams(budget=0.5, max_ratio=0.4, sink_tokens=1)).strategy()
    state = SelectionState.start(LENGTHS)
    v = torch.rand(25, generator=torch.Generator().manual_seed(4))
    _measured(strategy, state, 1, torch.zeros(25), v)
    over = int((v > 0.5).sum())
    want = _slow_top(v.tolist(), min(over, round(0.4 * 25)), set(_slow_sinks(LENGTHS, 1)))
    assert strategy.select(state, 1).tolist() == want
    calm = SelectionState.start(LENGTHS)
    _measured(strategy, calm, 1, torch.zeros(25), torch.full((25,), 0.01))
    assert strategy.select(calm, 1).numel() == 0  # nothing deviates: nothing recomputed, sinks included


def test_fixed_strategies_pick_their_tokens_up_front():
    state = SelectionState.start(LENGTHS)
    assert FusionConfig("naive", 0.5).strategy().initial(state).numel() == 0
    assert FusionConfig("full", 0.0).strategy().initial(state).tolist() == list(range(25))
    assert FusionConfig("sink", 0.0, SinkParams(sink_tokens=3)).strategy().initial(state).tolist() == _slow_sinks(
        LENGTHS, 3
    )
    rnd = FusionConfig("random", 0.4).strategy()
    picked = rnd.initial(state)
    assert picked.numel() == 10 and torch.equal(picked, rnd.initial(state))  # seeded: repeatable
    assert picked.tolist() == sorted(set(picked.tolist()))
    for name in ("naive", "full", "sink", "random", "query_attn"):
        assert FusionConfig(name, 0.2).strategy().check_layers(state, 4) == ()


def test_query_strategies_without_a_question_fall_back():
    state = SelectionState.start(LENGTHS)  # no query_attention: no suffix was given
    assert FusionConfig("query_attn", 0.3).strategy().initial(state).tolist() == _slow_sinks(LENGTHS, 2)
    assert FusionConfig("query_focus", 0.3).strategy().initial(state).tolist() == list(range(25))
    assert FusionConfig("query_focus", 0.0).strategy().initial(state).numel() == 0  # budget 0: naive


def test_query_attn_and_query_focus_start_from_what_the_question_attends_after_the_check_layer():
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(5)
    state.query_attention = torch.rand(4, 25, generator=g)  # [layers, chunk tokens]
    later = state.query_attention[2:].sum(0).tolist()  # layers after check layer 1
    attn = FusionConfig("query_attn", 0.4).strategy()  # room for all 7 sinks, then the 3 most attended
    assert attn.initial(state).tolist() == _slow_top(later, round(0.4 * 25), set(_slow_sinks(LENGTHS, 2)))
    focus = FusionConfig("query_focus", 0.1, QueryFocusParams(focus_ratio=0.5)).strategy()
    share = max(0.5, 0.1 * 2.0)
    assert focus.initial(state).tolist() == _slow_top(later, round(share * 25), set(_slow_sinks(LENGTHS, 2)))


def test_query_score_is_normalized_deviation_times_later_attention():
    strategy = FusionConfig("query", 0.2, QueryParams(query_weight=2.0, sink_tokens=0)).strategy()
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(6)
    state.query_attention = torch.rand(4, 25, generator=g)
    active = torch.arange(0, 25, 2)  # 13 tokens measured
    v = torch.rand(13, generator=g)
    strategy.observe(state, 1, active, k_dev=torch.zeros(13), v_dev=v)
    imp = state.query_attention[2:].sum(0)[active]
    want = v / v.mean() * (imp / imp.mean() + 1e-3) ** 2.0
    torch.testing.assert_close(strategy.score(state, 1), want)
    assert strategy.select(state, 1).tolist() == _slow_top(want.tolist(), round(0.2 * 25), set())


def test_craft_picks_the_later_chunks_sinks_then_the_top_stored_scores():
    state = SelectionState.start(LENGTHS)
    state.stored_scores = torch.rand(25, generator=torch.Generator().manual_seed(7))
    first = LENGTHS[0]
    later = [i for i in range(25) if i >= first]
    masked = [float(state.stored_scores[i]) if i >= first else float("-inf") for i in range(25)]
    sinks = set(_slow_sinks(LENGTHS, 2)) - set(range(first))
    craft = FusionConfig("craft", 0.4).strategy()
    assert craft.initial(state).tolist() == _slow_top(masked, round(0.4 * 25), sinks)
    assert craft.check_layers(state, 4) == () and not craft.wants_query_attention
    assert FusionConfig("craft", 1.0).strategy().initial(state).tolist() == later  # the first chunk is exact
    every = FusionConfig("craft", 0.4, CraftParams(first_chunk_exact=False)).strategy()
    want = _slow_top(state.stored_scores.tolist(), round(0.4 * 25), set(_slow_sinks(LENGTHS, 2)))
    assert every.initial(state).tolist() == want
    assert FusionConfig("craft", 0.0).strategy().initial(state).numel() == 0  # budget 0: naive
    one = SelectionState.start([9])
    one.stored_scores = torch.rand(9)
    assert FusionConfig("craft", 0.5).strategy().initial(one).numel() == 0  # one chunk: all of it exact


def test_craft_query_weights_the_stored_score_by_later_attention():
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(8)
    state.stored_scores = torch.rand(25, generator=g)
    strategy = FusionConfig("craft_query", 0.3, CraftQueryParams(query_weight=2.0)).strategy()
    assert strategy.score(state).tolist() == state.stored_scores.tolist()  # no question: craft's score
    state.query_attention = torch.rand(4, 25, generator=g)
    imp = state.query_attention[2:].sum(0)  # layers after check layer 1
    want = state.stored_scores / state.stored_scores.mean() * (imp / imp.mean() + 1e-3) ** 2.0
    torch.testing.assert_close(strategy.score(state), want)
    masked = [float(want[i]) if i >= LENGTHS[0] else float("-inf") for i in range(25)]
    sinks = set(_slow_sinks(LENGTHS, 2)) - set(range(LENGTHS[0]))
    assert strategy.initial(state).tolist() == _slow_top(masked, round(0.3 * 25), sinks)
    assert strategy.wants_query_attention and strategy.wants_stored_scores


def test_craft_methods_say_how_to_pass_the_stored_scores():
    state = SelectionState.start(LENGTHS)
    for name in ("craft", "craft_query"):
        with pytest.raises(ValueError, match=f"{name}.*record_deviation"):
            FusionConfig(name, 0.2).strategy().initial(state)
    state.stored_scores = torch.zeros(24)
    with pytest.raises(ValueError, match="expected \\(25,\\)"):
        FusionConfig("craft", 0.2).strategy().initial(state)
    with pytest.raises(ValueError, match="sink_tokens"):
        CraftQueryParams(sink_tokens=-1)
