"""``RateEstimate``: a running estimate of a rate (bytes/s, tokens/s) from real measurements.

>>> r = RateEstimate(first=100.0, weight=0.5)
>>> r.rate, r.observe(300.0, 1.0), r.rate
(100.0, None, 150.0)
"""

from __future__ import annotations

import threading

__all__ = ["RateEstimate"]


class RateEstimate:
    """An exponentially weighted moving average of a rate, ``amount / seconds``. Thread-safe.

    It starts at ``first`` (a sane guess, used until something is measured) and moves by
    ``weight`` towards each measurement. The average is taken over seconds per unit (the inverse
    of the rate), so a drop shows at once (1 Gbit/s then one read at 20 Mbit/s estimates 64 Mbit/s,
    where averaging rates would say 700) and a recovery over a few reads: plans made on it err
    towards the cheaper choice.
    """

    def __init__(self, first: float, weight: float = 0.3) -> None:
        if not first > 0:
            raise ValueError(f"first must be a positive rate, got {first!r}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self._inverse, self.weight = 1.0 / float(first), weight  # seconds per unit
        self.samples = 0  # measurements taken so far
        self._lock = threading.Lock()

    @property
    def rate(self) -> float:
        """The current estimate (per second)."""
        return 1.0 / self._inverse

    def observe(self, amount: float, seconds: float) -> None:
        """Take one measurement: ``amount`` done in ``seconds`` (ignored unless both are positive)."""
        if amount <= 0 or seconds <= 0:
            return
        with self._lock:
            self._inverse += self.weight * (seconds / amount - self._inverse)
            self.samples += 1

    def seconds(self, amount: float) -> float:
        """How long ``amount`` takes at the current estimate."""
        return amount * self._inverse

    def seed(self, rate: float) -> None:
        """Start from an earlier measurement (another process's, read back from disk); counts as one."""
        if not 0 < rate < float("inf"):
            raise ValueError(f"a seed needs a finite rate > 0; got {rate!r}")
        with self._lock:
            self._inverse = 1.0 / float(rate)
            self.samples = max(self.samples, 1)
