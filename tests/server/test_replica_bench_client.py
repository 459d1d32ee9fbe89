"""``ragkv bench replicas``' client against a real ``ragkv serve``: its closed and open loops, and its options.

The bench itself needs Ray Serve, Redis and PostgreSQL and runs for minutes (docs/benchmarks.md); what
these tests pin down is the part that decides how requests arrive, which the figures depend on.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest
from typer.testing import CliRunner

from ragkv.bench.goodput import poisson_arrivals
from ragkv.bench.replicas import ReplicaBenchConfig, _workload
from ragkv.cli import app

QUESTIONS = ["What grows on trees?", "What floats on water?", "Who picks apples?", "Where do boats go?"] * 2


def test_arrival_times_are_seeded_poisson_at_the_rate():
    times = poisson_arrivals(4000, 5.0, seed=3)
    assert times == poisson_arrivals(4000, 5.0, seed=3)  # every router gets the same times
    assert times != poisson_arrivals(4000, 5.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.08)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)


def test_open_loop_sends_every_question_at_its_arrival_time(server):
    config = ReplicaBenchConfig(requests=len(QUESTIONS), rate=8.0, seed=1, max_tokens=2)
    results, wall = asyncio.run(_workload(server.url, QUESTIONS, config))
    assert len(results) == len(QUESTIONS)
    assert all("error" not in r and r["ttft"] > 0 for r in results), results
    # the last question left at its arrival time, not before: the run lasts at least that long
    assert wall >= poisson_arrivals(len(QUESTIONS), 8.0, 1)[-1]


def test_closed_loop_answers_every_question(server):
    config = ReplicaBenchConfig(requests=len(QUESTIONS), concurrency=3, max_tokens=2)
    results, _ = asyncio.run(_workload(server.url, QUESTIONS, config))
    assert len(results) == len(QUESTIONS) and all("error" not in r for r in results), results


def test_rate_must_not_be_negative():
    with pytest.raises(ValueError, match="rate"):
        ReplicaBenchConfig(rate=-1.0)


def test_a_limited_link_refuses_outside_services_before_starting_anything():
    result = CliRunner().invoke(
        app, ["bench", "replicas", "--link-mbit", "100", "--redis", "redis://127.0.0.1:6379/15"]
    )
    assert result.exit_code == 2
    assert "--link-mbit runs its own Redis" in result.output


def test_a_bad_router_setting_is_refused_in_one_line_before_anything_starts():
    result = CliRunner().invoke(app, ["bench", "replicas", "--balance", "0.5"])
    assert result.exit_code == 2
    assert "balance must be >= 1" in result.output
