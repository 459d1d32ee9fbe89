"""Selection strategies without a model: parameter records, the state, and each selection against
the obvious written-out rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragkv.fusion import FusionConfig
from ragkv.selection import (
    BlendParams,
    NoParams,
    QueryFocusParams,
    SelectionState,
    Strategy,
    available_strategies,
    coverage_count,
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
    with pytest.raises(TypeError, match="'blend' takes BlendParams, got QueryFocusParams"):
        FusionConfig("blend", 0.2, QueryFocusParams())
    with pytest.raises(TypeError, match="NoParams"):
        FusionConfig("naive", 0.0, BlendParams())


def test_config_keeps_method_and_ratio_and_switches_method_freely():
    cfg = FusionConfig(method="query_focus", ratio=0.15)
    assert cfg.strategy().ratio == 0.15 and isinstance(cfg.strategy().params, QueryFocusParams)
    assert isinstance(dataclasses.replace(cfg, method="blend").strategy().params, BlendParams)
    with pytest.raises(ValueError, match="unknown fusion method 'nope'"):
        FusionConfig(method="nope")
    with pytest.raises(ValueError, match="ratio"):
        FusionConfig(ratio=-0.1)


def test_the_shipped_methods_are_the_measured_ones():
    assert available_strategies() == ["blend", "full", "naive", "query_focus"]


def test_records_are_flat_and_check_their_knobs():
    for record in (NoParams, BlendParams, QueryFocusParams):
        assert record.__mro__[1].__name__ == "StrategyParams" and not dataclasses.fields(record.__mro__[1])
    p = QueryFocusParams(narrow_layer=3, query_weight=2.0, sink_tokens=1, deviation="kv")
    assert (p.narrow_layer, p.query_weight, p.sink_tokens, p.deviation, p.check_layer) == (3, 2.0, 1, "kv", 1)
    for bad in ({"sink_tokens": -1}, {"check_layer": -1}, {"deviation": "q"}, {"focus_ratio": -0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QueryFocusParams(**bad)
    for bad in ({"check_layer": -1}, {"deviation": "q"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BlendParams(**bad)
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
def test_blend_keeps_the_top_ratio_by_deviation(deviation):
    strategy = FusionConfig("blend", 0.3, BlendParams(deviation=deviation)).strategy()
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(1)
    k_dev, v_dev = torch.rand(25, generator=g), torch.rand(25, generator=g)
    _measured(strategy, state, 1, k_dev, v_dev)
    score = {"k": k_dev, "v": v_dev, "kv": k_dev + v_dev}[deviation]
    assert strategy.select(state, 1).tolist() == _slow_top(score.tolist(), round(0.3 * 25), set())
    assert strategy.check_layers(state, 4) == (1,) and strategy.check_layers(state, 1) == (0,)
    assert strategy.initial(state).tolist() == list(range(25))
    assert FusionConfig("blend", 0.01).strategy().initial(state).numel() == 0  # budget 0: naive


def test_query_focus_cuts_wide_then_narrows_at_a_deeper_layer():
    params = QueryFocusParams(narrow_factor=2.5, sink_tokens=0, query_weight=0.0)  # weight 0: deviation alone
    strategy = FusionConfig("query_focus", 0.2, params).strategy()
    state = SelectionState.start(LENGTHS)
    assert strategy.check_layers(state, 16) == (1, 4)  # narrow_layer 0: num_layers // 4
    deeper = FusionConfig("query_focus", 0.2, QueryFocusParams(narrow_layer=9)).strategy()
    assert deeper.check_layers(state, 16) == (1, 9)
    assert strategy.check_layers(state, 2) == (1,)  # no deeper layer left
    v = torch.rand(25, generator=torch.Generator().manual_seed(2))
    _measured(strategy, state, 1, torch.zeros(25), v)
    first = strategy.select(state, 1)
    assert first.tolist() == _slow_top(v.tolist(), round(0.2 * 2.5 * 25), set())
    v2 = torch.rand(first.numel(), generator=torch.Generator().manual_seed(3))
    strategy.observe(state, 4, first, k_dev=torch.zeros(first.numel()), v_dev=v2)
    assert strategy.select(state, 4).tolist() == _slow_top(v2.tolist(), round(0.2 * 25), set())


def test_fixed_strategies_pick_their_tokens_up_front():
    state = SelectionState.start(LENGTHS)
    assert FusionConfig("naive", 0.5).strategy().initial(state).numel() == 0
    assert FusionConfig("full", 0.0).strategy().initial(state).tolist() == list(range(25))
    for name in ("naive", "full"):
        assert FusionConfig(name, 0.2).strategy().check_layers(state, 4) == ()


def test_query_focus_without_a_question_runs_every_token_through_the_checks():
    state = SelectionState.start(LENGTHS)  # no query_attention: no suffix was given
    assert FusionConfig("query_focus", 0.3).strategy().initial(state).tolist() == list(range(25))
    assert FusionConfig("query_focus", 0.0).strategy().initial(state).numel() == 0  # budget 0: naive


def test_query_focus_starts_from_what_the_question_attends_after_the_check_layer():
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(5)
    state.query_attention = torch.rand(4, 25, generator=g)  # [layers, chunk tokens]
    later = state.query_attention[2:].sum(0).tolist()  # layers after check layer 1
    focus = FusionConfig("query_focus", 0.1, QueryFocusParams(focus_ratio=0.5)).strategy()
    share = max(0.5, 0.1 * 2.0)
    assert focus.initial(state).tolist() == _slow_top(later, round(share * 25), set(_slow_sinks(LENGTHS, 2)))
    exact = FusionConfig("query_focus", 0.1, QueryFocusParams(focus_ratio=0.5, first_chunk_exact=True)).strategy()
    masked = [x if i >= LENGTHS[0] else float("-inf") for i, x in enumerate(later)]
    sinks = set(_slow_sinks(LENGTHS, 2)) - set(range(LENGTHS[0]))
    assert exact.initial(state).tolist() == _slow_top(masked, round(share * 25), sinks)


def test_query_focus_score_is_normalized_deviation_times_later_attention():
    params = QueryFocusParams(query_weight=2.0, sink_tokens=1)
    strategy = FusionConfig("query_focus", 0.2, params).strategy()
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(6)
    state.query_attention = torch.rand(4, 25, generator=g)
    active = torch.arange(0, 25, 2)  # 13 tokens measured
    v = torch.rand(13, generator=g)
    strategy.observe(state, 1, active, k_dev=torch.zeros(13), v_dev=v)
    imp = state.query_attention[2:].sum(0)[active]
    want = v / v.mean() * (imp / imp.mean() + 1e-3) ** 2.0
    torch.testing.assert_close(strategy.score(state, 1), want)
    sinks = {i for i, t in enumerate(active.tolist()) if t in set(_slow_sinks(LENGTHS, 1))}
    # the first check keeps ratio * narrow_factor, the chunks' first tokens whatever their score
    assert strategy.select(state, 1).tolist() == _slow_top(want.tolist(), round(0.2 * 2.0 * 25), sinks)


def test_number_spans_pull_in_whole_numbers_and_boost_weighs_their_tokens():
    state = SelectionState.start(LENGTHS)
    g = torch.Generator().manual_seed(8)
    state.query_attention = torch.rand(4, 25, generator=g)
    runs = torch.full((25,), -1)
    runs[3:6], runs[10:14], runs[20] = 0, 1, 2  # three numbers
    state.number_runs = runs
    later = state.query_attention[2:].sum(0)
    plain = FusionConfig("query_focus", 0.1, QueryFocusParams(focus_ratio=0.2, sink_tokens=0)).strategy()
    spans = FusionConfig(
        "query_focus", 0.1, QueryFocusParams(focus_ratio=0.2, sink_tokens=0, number_spans=True)
    ).strategy()
    base = plain.initial(state)
    want = set(base.tolist())
    for run in {int(runs[i]) for i in base.tolist()} - {-1}:  # the obvious way: whole runs added
        want |= {i for i in range(25) if int(runs[i]) == run}
    assert spans.initial(state).tolist() == sorted(want)
    # at a check layer only active tokens can join: run 1 is half active
    active = torch.tensor([0, 4, 5, 11, 12, 20, 22])
    chosen = torch.tensor([3])  # index into active: token 11 (run 1)
    assert state.complete_numbers(chosen, active).tolist() == [3, 4]  # tokens 11 and 12, not 10 or 13
    boost = QueryFocusParams(focus_ratio=0.2, sink_tokens=0, number_boost=50.0)
    boosted = FusionConfig("query_focus", 0.1, boost).strategy().initial(state)
    weighted = [x * (50.0 if int(runs[i]) >= 0 else 1.0) for i, x in enumerate(later.tolist())]
    assert boosted.tolist() == _slow_top(weighted, round(0.2 * 25), set())
    with pytest.raises(ValueError, match="number_boost"):
        QueryFocusParams(number_boost=0.0)
    assert not plain.wants_numbers and spans.wants_numbers


def _slow_coverage_count(score: list[float], coverage: float, forced: set[int]) -> int:
    """The fewest tokens, best first (forced first, then higher score), whose scores reach ``coverage``."""
    order = sorted(range(len(score)), key=lambda i: (i not in forced, -score[i]))
    total = sum(score[i] for i in order)
    mass = 0.0
    for count, i in enumerate(order):
        if mass >= coverage * total:
            return count
        mass += score[i]
    return len(order)


def test_coverage_count_is_the_smallest_prefix_reaching_the_target():
    g = torch.Generator().manual_seed(11)
    for trial in range(20):
        n = 1 + trial * 3
        score = torch.rand(n, generator=g).pow(3)  # skewed: a few tokens hold most of the mass
        forced = torch.rand(n, generator=g) < 0.15
        marked = set(torch.nonzero(forced).flatten().tolist())
        for coverage in (0.0, 0.1, 0.5, 0.8, 0.95, 1.0):
            want = _slow_coverage_count(score.double().tolist(), coverage, marked)
            assert coverage_count(score, coverage, forced) == want, (n, coverage)
    assert coverage_count(torch.zeros(5), 0.9) == 0  # no mass to cover
    assert coverage_count(torch.zeros(0), 0.9) == 0


def _query_focus(ratio: float, **knobs) -> Strategy:
    return FusionConfig("query_focus", ratio, QueryFocusParams(sink_tokens=1, query_weight=0.0, **knobs)).strategy()


def test_coverage_keeps_the_covering_count_between_floor_and_cap_at_the_last_check():
    g = torch.Generator().manual_seed(12)
    v = torch.rand(25, generator=g).pow(4)
    sinks = set(_slow_sinks(LENGTHS, 1))
    cap, floor = round(0.4 * 25), round(0.1 * 25)
    seen = set()
    for coverage in (0.05, 0.3, 0.5, 0.7, 0.99):
        strategy = _query_focus(0.4, coverage=coverage, min_ratio=0.1)
        state = SelectionState.start(LENGTHS)
        state.checks = (1,)  # one check: it is the last, where coverage acts
        _measured(strategy, state, 1, torch.zeros(25), v)
        score = (v / v.mean()).tolist()  # query_weight 0: normalized deviation alone
        wanted = _slow_coverage_count(score, coverage, sinks)
        k = max(floor, min(wanted, cap))
        seen.add("floor" if k == floor else "cap" if k == cap else "between")
        assert strategy.select(state, 1).tolist() == _slow_top(score, k, sinks), coverage
        assert state.wanted_share == wanted / 25 and state.capped == (wanted > cap)
    assert seen == {"floor", "between", "cap"}
    # a floor above the cap is clamped to it
    strategy = _query_focus(0.1, coverage=0.01, min_ratio=0.5)
    state = SelectionState.start(LENGTHS)
    state.checks = (1,)
    _measured(strategy, state, 1, torch.zeros(25), v)
    assert strategy.select(state, 1).numel() == round(0.1 * 25)


def test_coverage_leaves_the_first_of_two_checks_at_ratio_times_narrow_factor():
    g = torch.Generator().manual_seed(13)
    strategy = _query_focus(0.2, coverage=0.9, min_ratio=0.0)
    state = SelectionState.start(LENGTHS)  # checks not recorded: the second check is the last
    v = torch.rand(25, generator=g)
    _measured(strategy, state, 1, torch.zeros(25), v)
    first = strategy.select(state, 1)
    assert first.numel() == round(0.2 * 2.0 * 25) and state.wanted_share is None
    v2 = torch.rand(first.numel(), generator=g)
    strategy.observe(state, 4, first, k_dev=torch.zeros(first.numel()), v_dev=v2)
    score = (v2 / v2.mean()).tolist()
    forced = set(torch.nonzero(state.sink_mask(first, 1)).flatten().tolist())
    wanted = _slow_coverage_count(score, 0.9, forced)
    assert strategy.select(state, 4).tolist() == _slow_top(score, min(wanted, round(0.2 * 25)), forced)
    assert state.wanted_share == wanted / 25


@pytest.mark.parametrize("bad", [{"coverage": 1.5}, {"coverage": -0.1}, {"min_ratio": 2.0}, {"min_ratio": -1.0}])
def test_coverage_knobs_outside_zero_one_are_refused_saying_what_they_mean(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be in \\[0, 1\\]"):
        QueryFocusParams(**bad)
    assert QueryFocusParams().coverage == 0.0  # off by default: ratio is a fixed share
