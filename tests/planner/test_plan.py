"""The load planner as a pure function: properties over random chunks, sizes, rates and budgets."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.planner.plan import LOCAL, TEXT, ChunkOptions, Rates, plan_load, plan_seconds
from ragkv.types import CodecSpec

ORDER = [CodecSpec("cachegen", level) for level in range(4)]  # best quality first


@st.composite
def chunk_options(draw: st.DrawFn) -> ChunkOptions:
    tokens = draw(st.integers(1, 2000))
    stored = draw(st.lists(st.sampled_from(ORDER), unique=True, max_size=len(ORDER)))
    # a cheaper level is never bigger than a better one of the same chunk
    sizes = sorted((draw(st.integers(1_000, 20_000_000)) for _ in stored), reverse=True)
    ordered = sorted(stored, key=ORDER.index)
    return ChunkOptions(tokens, dict(zip(ordered, sizes, strict=True)))


rates_st = st.builds(
    Rates,
    transfer_bps=st.floats(1e3, 1e10),
    recompute_tps=st.floats(10, 1e6),
    decode_bps=st.fixed_dictionaries({}, optional={"cachegen": st.floats(1e5, 1e10)}),
    latency_s=st.floats(0, 0.1),
    fusion_ratio=st.floats(0, 0.5),
)
slacks = st.none() | st.floats(0, 1)
budgets = st.none() | st.floats(0, 100)


def _rank(choice: CodecSpec | str | None) -> int:
    """A level's place in ORDER; the fallbacks (text, local) after every level."""
    return len(ORDER) if choice is TEXT or choice == LOCAL else ORDER.index(choice)


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), max_size=6), rates_st, budgets, slacks)
def test_never_picks_a_level_not_stored(chunks, rates, budget, slack):
    plan = plan_load(chunks, ORDER, rates, budget, slack=slack)
    assert len(plan.choices) == len(chunks)
    for chunk, choice in zip(chunks, plan.choices, strict=True):
        assert choice is TEXT or choice == LOCAL or choice in chunk.sizes


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), min_size=1, max_size=6), rates_st, budgets, slacks)
def test_picks_text_when_every_level_is_slower_than_recompute(chunks, rates, budget, slack):
    plan = plan_load(chunks, ORDER, rates, budget, slack=slack)
    for chunk, choice in zip(chunks, plan.choices, strict=True):
        text = rates.text_seconds(chunk.tokens)
        if all(rates.chunk_seconds(spec, chunk) > text for spec in chunk.sizes):
            assert choice is TEXT or choice == LOCAL
        if isinstance(choice, CodecSpec):  # a level is only ever picked when it beats recomputing
            assert rates.chunk_seconds(choice, chunk) <= text


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), min_size=1, max_size=6), rates_st, budgets, st.floats(1.0, 1000.0))
def test_more_bandwidth_never_lowers_quality(chunks, rates, budget, factor):
    """With a deadline or none (quality first). With ``slack`` it can fail per chunk (a faster link that
    makes one more chunk worth loading can tip the whole plan to a cheaper cap), so it is not claimed."""
    slow = plan_load(chunks, ORDER, rates, budget)
    fast_rates = replace(rates, transfer_bps=rates.transfer_bps * factor)
    fast = plan_load(chunks, ORDER, fast_rates, budget)
    for a, b in zip(slow.choices, fast.choices, strict=True):
        assert _rank(b) <= _rank(a)
    assert fast.fits or not slow.fits


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), min_size=1, max_size=6), rates_st, st.floats(0, 100))
def test_a_plan_that_fits_is_the_best_quality_cap_that_fits(chunks, rates, budget):
    plan = plan_load(chunks, ORDER, rates, budget)
    free = plan_load(chunks, ORDER, rates, None)  # no deadline: the best that beats recomputing
    if free.seconds <= budget:
        assert plan.choices == free.choices
    assert plan.fits == (plan.seconds <= budget)
    if not plan.fits:  # nothing fits: the fastest plan, which is no slower than all-text
        assert plan.seconds <= sum(rates.text_seconds(c.tokens) for c in chunks) + 1e-9


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), min_size=1, max_size=6), rates_st, st.floats(0, 1), st.floats(0, 10))
def test_with_slack_the_best_quality_within_it_of_the_fastest(chunks, rates, slack, base):
    plan = plan_load(chunks, ORDER, rates, slack=slack, base_s=base)
    quality = plan_load(chunks, ORDER, rates)  # quality first: the best that beats recomputing
    # quality first over the levels from rank r on is the plan at cap r: the fastest of those is the
    # one slack is measured from (without a deadline no chunk is moved to LOCAL)
    fastest_s = min(plan_load(chunks, ORDER[r:], rates).seconds for r in range(len(ORDER)))
    assert base + plan.seconds <= (1 + slack) * (base + fastest_s) + 1e-9
    assert plan.fits and plan.seconds >= fastest_s - 1e-9
    assert LOCAL not in plan.choices
    if base + quality.seconds <= (1 + slack) * (base + fastest_s):
        assert plan.choices == quality.choices  # quality first when it costs little


def test_slack_trades_a_little_quality_for_a_lot_of_time():
    """At 100 Mbit/s, level 0 is 4x the bytes of level 3: without slack level 0 (it beats recomputing),
    with 5% slack level 3 (level 0 makes the answer 50% slower); on a fast link level 0 either way."""
    chunk = ChunkOptions(400, {ORDER[0]: 2_000_000, ORDER[3]: 500_000})
    slow = Rates(12.5e6, 400.0, fusion_ratio=0.15)  # 100 Mbit/s: 0.16 s vs 0.04 s; text 1 s
    assert plan_load([chunk] * 4, ORDER, slow).choices == (ORDER[0],) * 4
    assert plan_load([chunk] * 4, ORDER, slow, slack=0.05, base_s=1.0).choices == (ORDER[3],) * 4
    fast = Rates(1.25e9, 400.0, fusion_ratio=0.15)  # 10 Gbit/s: 1.6 ms vs 0.4 ms
    assert plan_load([chunk] * 4, ORDER, fast, slack=0.05, base_s=1.0).choices == (ORDER[0],) * 4


def test_latency_counts_per_read():
    """Many small reads over a slow round trip: text wins though the bytes alone would be quick."""
    chunk = ChunkOptions(50, {ORDER[0]: 10_000})
    assert plan_load([chunk], ORDER, Rates(125e6, 1000.0)).choices == (ORDER[0],)
    assert plan_load([chunk], ORDER, Rates(125e6, 1000.0, latency_s=0.2)).choices == (TEXT,)


def test_no_deadline_on_a_fast_link_loads_the_best_level():
    chunk = ChunkOptions(400, {ORDER[0]: 2_000_000, ORDER[2]: 600_000})
    plan = plan_load([chunk, chunk], ORDER, Rates(1.25e9, 1000.0))
    assert plan.choices == (ORDER[0], ORDER[0]) and plan.fits


def test_a_tight_deadline_moves_to_cheaper_levels_then_text():
    chunk = ChunkOptions(400, {ORDER[0]: 2_000_000, ORDER[3]: 250_000})
    rates = Rates(12.5e6, 1000.0)  # 100 Mbit/s: level 0 0.16 s, level 3 0.02 s, text 0.4 s
    assert plan_load([chunk] * 2, ORDER, rates, 1.0).choices == (ORDER[0], ORDER[0])
    assert plan_load([chunk] * 2, ORDER, rates, 0.1).choices == (ORDER[3], ORDER[3])
    slow = Rates(1e5, 1000.0)  # 0.8 Mbit/s: even level 3 takes 2.5 s, text wins
    assert plan_load([chunk] * 2, ORDER, slow, 0.1).choices == (TEXT, TEXT)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="recompute_tps"):
        plan_load([ChunkOptions(1)], ORDER, Rates(1.0, 0.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_options(), min_size=1, max_size=6), rates_st, budgets)
def test_plan_seconds_without_local_chunks_is_the_sum_of_each_chunks_cost(chunks, rates, budget):
    """The two-path estimate reduces to the plain sum (a decode overlaps its own read) when nothing is
    prefilled locally: the slow, obvious form of the estimate every cap plan is ranked by."""
    plan = plan_load(chunks, ORDER, rates, budget)
    choices = [c if isinstance(c, CodecSpec) else TEXT for c in plan.choices]
    slow = sum(
        rates.text_seconds(chunk.tokens) if choice is TEXT else rates.chunk_seconds(choice, chunk)
        for chunk, choice in zip(chunks, choices, strict=True)
    )
    assert plan_seconds(chunks, choices, rates) == pytest.approx(slow, rel=1e-9, abs=1e-12)


def test_a_deadline_no_cap_meets_prefills_the_earliest_chunk_here_while_the_rest_arrive():
    """20 Mbit/s: level 3 reads take 0.4 s, text 0.5 s. All level 3 (1.43 s) and all text (1.5 s) miss
    1.1 s; prefilling the first chunk here while the other two are read meets it (1.03 s)."""
    chunk = ChunkOptions(400, {ORDER[0]: 4_000_000, ORDER[3]: 1_000_000})
    rates = Rates(2.5e6, 800.0, fusion_ratio=0.15)
    level3 = plan_seconds([chunk] * 3, [ORDER[3]] * 3, rates)
    text = plan_seconds([chunk] * 3, [TEXT] * 3, rates)
    assert level3 > 1.1 and text > 1.1
    plan = plan_load([chunk] * 3, ORDER, rates, 1.1)
    assert plan.choices == (LOCAL, ORDER[3], ORDER[3]) and plan.fits
    assert plan.seconds == pytest.approx(0.8 + 3 * 0.5 * 0.15)
    # with room for the levels, or without a deadline, nothing is prefilled here
    assert LOCAL not in plan_load([chunk] * 3, ORDER, rates, 2.0).choices
    assert LOCAL not in plan_load([chunk] * 3, ORDER, rates).choices
    assert LOCAL not in plan_load([chunk] * 3, ORDER, rates, slack=0.05).choices


def test_prefills_already_queued_here_are_not_double_booked():
    """Two chunks left, one earlier chunk still to prefill here (0.5 s): prefilling another here would
    end after reading both, so both are read."""
    chunk = ChunkOptions(400, {ORDER[3]: 1_000_000})
    rates = Rates(2.5e6, 800.0, fusion_ratio=0.15)  # level 3 read 0.4 s, prefill 0.5 s
    assert plan_load([chunk] * 2, ORDER, rates, 0.7).choices == (LOCAL, ORDER[3])
    queued = plan_load([chunk] * 2, ORDER, rates, 0.7, busy_s=0.5)
    assert queued.choices == (ORDER[3], ORDER[3]) and not queued.fits
    assert queued.seconds == pytest.approx(0.8 + 2 * 0.5 * 0.15)


def test_decodes_running_side_by_side_add_their_overlap_less_to_a_load():
    """Slow decodes on a fast link: the decodes bound the load. Two at a time (``decode_overlap`` 2)
    halve what they add, and make a level worth loading that one thread would leave as text."""
    chunk = ChunkOptions(400, {ORDER[0]: 2_000_000})
    one = Rates(1e12, 1000.0, {str(ORDER[0]): 6e6})  # a decode 0.33 s, the read ~0, text 0.4 s
    two = Rates(1e12, 1000.0, {str(ORDER[0]): 6e6}, decode_overlap=2.0)
    assert plan_seconds([chunk] * 4, [ORDER[0]] * 4, one) == pytest.approx(4 / 3)
    assert plan_seconds([chunk] * 4, [ORDER[0]] * 4, two) == pytest.approx(2 / 3)
    slower = Rates(1e12, 1000.0, {str(ORDER[0]): 4e6})  # a decode 0.5 s on one thread: text is faster
    assert plan_load([chunk] * 2, ORDER, slower).choices == (TEXT, TEXT)
    assert plan_load([chunk] * 2, ORDER, replace(slower, decode_overlap=2.0)).choices == (ORDER[0], ORDER[0])
    assert replace(two, decode_overlap=0.5).decode_seconds(ORDER[0], 6_000_000) == pytest.approx(1.0)  # as 1
