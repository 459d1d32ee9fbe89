"""``RateEstimate``: a running estimate of a rate (bytes/s, tokens/s) from real measurements.

>>> r = RateEstimate(first=100.0, weight=0.5)
>>> r.rate, r.observe(300.0, 1.0), r.rate
(100.0, None, 200.0)
"""

from __future__ import annotations

import threading

__all__ = ["RateEstimate"]


class RateEstimate:
    """An exponentially weighted moving average of ``amount / seconds``. Thread-safe.

    It starts at ``first`` (a sane guess, used until something is measured) and moves by
    ``weight`` towards each measurement, so a change of link speed shows within a few reads.
    """

    def __init__(self, first: float, weight: float = 0.3) -> None:
        if not first > 0:
            raise ValueError(f"first must be a positive rate, got {first!r}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._rate, self.weight = float(first), weight
        self.samples = 0  # measurements taken so far
        self._lock = threading.Lock()

    @property
    def rate(self) -> float:
        """The current estimate (per second)."""
        return self._rate

    def observe(self, amount: float, seconds: float) -> None:
        """Take one measurement: ``amount`` done in ``seconds`` (ignored unless both are positive)."""
        if amount <= 0 or seconds <= 0:
            return
        with self._lock:
            self._rate += self.weight * (amount / seconds - self._rate)
            self.samples += 1

    def seconds(self, amount: float) -> float:
        """How long ``amount`` takes at the current estimate."""
        return amount / self._rate
