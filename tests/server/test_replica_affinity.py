"""The chunk-affinity score and ranking (ragkv.replicas.affinity): pure, no Ray."""

from __future__ import annotations

import doctest
import importlib
import random

import pytest

from ragkv.replicas.affinity import (
    AffinityConfig,
    ChunkRef,
    Holdings,
    RecentRoutes,
    ReplicaView,
    key_tag,
    load_bound,
    power_of_two,
    rank_replicas,
    score,
    window_bound,
)

A, B, C = (ChunkRef((key_tag(f"ns:{n}:int8"), key_tag(f"ns:{n}:cachegen")), tokens) for n, tokens in
           (("a", 300), ("b", 100), ("c", 100)))  # fmt: skip


def held(*chunks: ChunkRef, by: int = 0) -> Holdings:
    """A summary holding each chunk by one of its tags (``by``: which codec's entry)."""
    return Holdings(frozenset(c.tags[by] for c in chunks))


def test_score_is_matched_share_minus_capped_load():
    cfg = AffinityConfig(load_weight=0.5, load_cap=4)
    assert score(300, 500, 0, cfg) == pytest.approx(0.6)
    assert score(300, 500, 2, cfg) == pytest.approx(0.6 - 0.25)
    assert score(300, 500, 4, cfg) == score(300, 500, 400, cfg)  # the load term stops at load_cap
    assert score(0, 0, 0, cfg) == 0.0  # a request of no chunk tokens has no share


def test_in_flight_tokens_load_a_replica_as_its_queue_does():
    cfg = AffinityConfig(load_weight=0.5, load_cap=4, token_cap=1000)
    assert score(300, 500, 1, cfg, tokens=500) == pytest.approx(0.6 - 0.25)  # tokens outweigh the queue
    assert score(300, 500, 2, cfg, tokens=100) == pytest.approx(0.6 - 0.25)  # the queue outweighs tokens
    assert score(300, 500, 0, cfg, tokens=10**6) == score(300, 500, 4, cfg)  # capped alike
    # one replica holds a small share but runs one long prompt: the idle one wins
    views = {"long": ReplicaView(held(B), queue=1, tokens=1000), "idle": ReplicaView()}
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order == ("idle", "long")


def test_holder_of_most_chunk_tokens_ranks_first():
    views = {"r1": ReplicaView(held(B, C)), "r2": ReplicaView(held(A)), "r3": ReplicaView()}
    ranking = rank_replicas([A, B, C], views, AffinityConfig(), random.Random(0))
    assert ranking.how == "affinity"
    assert ranking.order == ("r2", "r1", "r3")  # 300 tokens beat 200, which beat none


def test_any_codec_entry_counts_as_held():
    views = {"r1": ReplicaView(held(A, by=1)), "r2": ReplicaView()}
    assert rank_replicas([A], views, AffinityConfig(), random.Random(0)).order[0] == "r1"


def test_load_outweighs_a_small_match():
    cfg = AffinityConfig(load_weight=0.5, load_cap=4)
    views = {"busy": ReplicaView(held(B), queue=4), "idle": ReplicaView()}  # share 0.2 - 0.5 < 0
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order == ("idle", "busy")


def test_load_does_not_outweigh_a_full_match():
    cfg = AffinityConfig(load_weight=0.5, load_cap=4, balance=0)  # the score alone
    views = {"holder": ReplicaView(held(A, B, C), queue=100), "idle": ReplicaView()}  # 1 - 0.5 > 0
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order == ("holder", "idle")


def test_bounded_loads_rank_a_holder_past_the_bound_last():
    cfg = AffinityConfig(load_weight=0.5, load_cap=4, balance=1.25)
    # 3 in flight over 3 replicas: each may hold ceil(1.25 * 4 / 3) = 2, the new request included
    views = {"holder": ReplicaView(held(A, B, C), queue=2), "idle": ReplicaView(), "other": ReplicaView(queue=1)}
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order[-1] == "holder"
    # within the bound the match wins
    views = {"holder": ReplicaView(held(A, B, C), queue=1), "idle": ReplicaView(queue=1), "other": ReplicaView(queue=1)}
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order[0] == "holder"
    with pytest.raises(ValueError, match="balance"):
        AffinityConfig(balance=0.5)


def test_bounded_loads_keep_every_replica_in_use_when_one_holds_everything():
    """The failure the bound exists for: every request matches one replica fully; the score alone
    sends them all there while they pile up, the bound spreads them (checked against the bound's
    definition, request by request)."""
    rng = random.Random(0)
    for balance, spread in ((0.0, False), (1.25, True), (2.0, True)):
        cfg = AffinityConfig(balance=balance)
        queues = {"holder": 0, "r2": 0, "r3": 0}
        routed = dict.fromkeys(queues, 0)
        for _ in range(200):
            views = {r: ReplicaView(held(A, B, C) if r == "holder" else Holdings(), queue=q) for r, q in queues.items()}
            first = rank_replicas([A, B, C], views, cfg, rng).order[0]
            if balance:
                assert queues[first] + 1 <= load_bound(list(queues.values()), balance)
            queues[first] += 1
            routed[first] += 1
            for r in queues:  # each replica finishes one of its requests now and then
                if queues[r] and rng.random() < 0.4:
                    queues[r] -= 1
        assert (min(routed.values()) > 0) is spread, routed


def test_nothing_held_falls_back_to_power_of_two():
    views = {f"r{i}": ReplicaView(queue=i) for i in range(5)}
    ranking = rank_replicas([A, B], views, AffinityConfig(), random.Random(1))
    assert ranking.how == "power_of_two"
    assert len(ranking.order) == 2 and len(set(ranking.order)) == 2 and set(ranking.order) <= set(views)
    # no chunks at all (a models call, a full prefill): power of two as well
    assert rank_replicas([], views, AffinityConfig(), random.Random(1)).how == "power_of_two"


def test_min_share_sends_weak_matches_to_power_of_two():
    views = {"r1": ReplicaView(held(B)), "r2": ReplicaView()}
    cfg = AffinityConfig(min_share=0.25)  # B is 100 of 500 tokens
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).how == "power_of_two"


def test_ties_go_to_the_shorter_queue_then_spread_at_random():
    views = {"r1": ReplicaView(held(A), queue=1), "r2": ReplicaView(held(A), queue=0)}
    cfg = AffinityConfig(load_weight=0.0)  # equal scores: the queue decides
    assert rank_replicas([A], views, cfg, random.Random(0)).order[0] == "r2"
    equal = {"r1": ReplicaView(held(A)), "r2": ReplicaView(held(A))}
    firsts = {rank_replicas([A], equal, cfg, random.Random(seed)).order[0] for seed in range(20)}
    assert firsts == {"r1", "r2"}  # an exact tie is not always the same replica


def test_holdings_summary_is_bounded_and_survives_a_bad_stat():
    summary = Holdings.of((f"ns:{i}" for i in range(100)), limit=10)
    assert len(summary.tags) == 10
    assert Holdings.from_stats(summary.as_stats()) == summary
    for junk in (None, 7, "abc", ["short", 3, None]):
        assert Holdings.from_stats(junk) == Holdings()  # a malformed summary holds nothing: a miss, no error
    with pytest.raises(ValueError, match="limit"):
        Holdings.of([], limit=0)


def test_power_of_two_draws_distinct_replicas():
    rng = random.Random(3)
    assert power_of_two(["only"], rng) == ("only",)
    for _ in range(50):
        pair = power_of_two(["a", "b", "c", "d"], rng)
        assert len(pair) == 2 and pair[0] != pair[1]


def test_bad_settings_say_what_to_pass():
    with pytest.raises(ValueError, match="load_cap"):
        AffinityConfig(load_cap=0)
    with pytest.raises(ValueError, match="load_weight"):
        AffinityConfig(load_weight=-1)


def test_recent_routes_count_as_held_until_they_expire_and_stay_bounded():
    one = [ChunkRef((key_tag(f"ns:{n}:int8"),), 100) for n in "wxyz"]  # one tag each
    w, x, y, z = one
    now = [100.0]
    recent = RecentRoutes(10.0, limit=3, clock=lambda: now[0])
    recent.add("r1", [w, x])
    assert recent.tags("r1") == frozenset(w.tags + x.tags) and recent.tags("r2") == frozenset()
    now[0] = 105.0
    recent.add("r1", [w])  # sent again: the newest now, so it outlives x
    now[0] = 110.0
    assert recent.tags("r1") == frozenset(w.tags)
    now[0] = 115.0
    assert recent.tags("r1") == frozenset()
    recent.add("r1", one)  # over the limit: the oldest goes first
    assert recent.tags("r1") == frozenset(x.tags + y.tags + z.tags)
    assert recent.replicas() == ["r1"]
    recent.forget("r1")
    assert recent.replicas() == []
    off = RecentRoutes(0.0, clock=lambda: now[0])  # recent_s=0: off
    off.add("r1", [w])
    assert off.tags("r1") == frozenset()
    with pytest.raises(ValueError, match="recent_s"):
        AffinityConfig(recent_s=-1)


@pytest.mark.parametrize("name", ["ragkv.replicas.affinity", "ragkv.bench.replicas"])
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_bench_table_says_how_close_affinity_came_to_the_best_possible_hit_rate():
    from ragkv.bench.replicas import format_replica_table

    base = {"requests": 4, "store_mb": 1.0, "ttft_p50": 1.0, "ttft_p95": 2.0, "req_s": 1.0, "load": "2/2",
            "max_over_mean": 1.0, "errors": 0, "errors_after_kill": "-", "best_hit_rate": 0.8}  # fmt: skip
    rows = [base | {"router": "affinity", "fast_hit_rate": 0.6}, base | {"router": "round_robin", "fast_hit_rate": 0.3}]
    text = format_replica_table(rows)
    assert "affinity / round-robin: 2.00x" in text
    assert "best possible fast-tier hit rate on this workload: 0.80 (affinity reaches 0.75 of it)" in text


def test_window_bound_ranks_a_replica_past_its_share_of_recent_routes_last():
    cfg = AffinityConfig(balance=0, window=12, window_balance=1.5)
    # of any 13 routes over 3 replicas one may take ceil(1.5 * 13 / 3) = 7, the new one included
    views = {"holder": ReplicaView(held(A, B, C), recent=7), "r2": ReplicaView(recent=3), "r3": ReplicaView(recent=2)}
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order[-1] == "holder"
    views["holder"] = ReplicaView(held(A, B, C), recent=6)  # within it the match wins
    assert rank_replicas([A, B, C], views, cfg, random.Random(0)).order[0] == "holder"
    for bad in ({"window": -1}, {"window_balance": 0.9}):
        with pytest.raises(ValueError, match="window"):
            AffinityConfig(**bad)


def test_window_bound_keeps_each_replicas_share_of_a_run_near_the_mean():
    """Every request matches one replica fully and requests never overlap (a low rate): the in-flight
    bound never binds, so without the window one replica takes everything; with it no replica takes
    more than the bound's share of any ``window + 1`` consecutive routes (checked route by route)."""
    from collections import deque

    rng = random.Random(0)
    for window, limited in ((0, False), (12, True), (24, True)):
        cfg = AffinityConfig(balance=0, window=window, window_balance=1.5)
        last: deque[str] = deque(maxlen=window or None)
        routed = dict.fromkeys(("holder", "r2", "r3"), 0)
        for _ in range(120):
            recent = {r: sum(1 for x in last if x == r) if window else 0 for r in routed}
            views = {r: ReplicaView(held(A, B, C) if r == "holder" else Holdings(), recent=recent[r]) for r in routed}
            first = rank_replicas([A, B, C], views, cfg, rng).order[0]
            if window:
                assert recent[first] + 1 <= window_bound(window, 3, 1.5)
            last.append(first)
            routed[first] += 1
        # bound 7 of every 13 routes (window 12), 13 of 25 (24): a share of 0.52-0.54, not 1
        assert (max(routed.values()) <= 0.55 * 120) is limited, routed
