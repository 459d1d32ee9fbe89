"""CircuitBreaker state transitions on a fake clock."""

from __future__ import annotations

import pytest

from ragkv.cache.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(failures=3, cooldown_s=10, clock=Clock())
    breaker.failure()
    breaker.failure()
    breaker.success()  # resets the count
    assert not breaker.failure() and not breaker.failure()
    assert breaker.failure()
    assert breaker.state == "open" and not breaker.allow()


def test_half_open_probe_closes_or_reopens() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=1, cooldown_s=10, clock=clock)
    breaker.failure()
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow() and breaker.state == "half-open"
    assert not breaker.allow()  # one probe at a time
    assert breaker.failure()  # the probe failed: open again, for a new cooldown
    clock.now += 5
    assert not breaker.allow()
    clock.now += 5
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failures=0)
