"""``LinkEstimate``: a running estimate of a link's read cost (per-request latency + bytes / rate)."""

from __future__ import annotations

import threading

__all__ = ["LinkEstimate"]


class LinkEstimate:
    """A running estimate of a link's read cost, ``seconds = latency + bytes / rate``. Thread-safe.

    Each read is one point (bytes, seconds); the estimate is an exponentially weighted least-squares
    line through them (weight ``weight`` on the newest), so reads of different sizes (a chunk's
    levels) separate the per-request latency from the bandwidth. While the reads seen are all of
    about one size the line cannot be told apart from its slope: the latency stays at its last
    value (``first_latency`` at first) and the rate takes the rest, which, averaged over seconds
    per byte as in :class:`~ragkv.planner.throughput.RateEstimate`, shows a drop at once.
    ``measured`` says whether anything was measured (or seeded from an earlier process, see
    :meth:`seed`; or the first guess is
    ``trusted``, a tier inside this machine). The first read replaces the first guess outright.

    >>> link = LinkEstimate(first=125e6, first_latency=0.001, weight=0.5)
    >>> link.observe(1_000_000, 0.011); link.observe(4_000_000, 0.041)
    >>> round(link.latency, 4), round(link.rate / 1e6)
    (0.001, 100)
    """

    def __init__(self, first: float, first_latency: float = 0.0, weight: float = 0.3, *, trusted: bool = False) -> None:
        if not first > 0:
            raise ValueError(f"first must be a positive rate, got {first!r}")
        if not first_latency >= 0:
            raise ValueError(f"first_latency must be >= 0 seconds, got {first_latency!r}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self.weight, self._first = weight, (float(first), float(first_latency))
        self.trusted = trusted  # the first guess is good enough to plan on (a tier in this machine)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every measurement: back to the first guess (a cold start)."""
        with self._lock:
            rate, latency = self._first
            self._latency, self._inverse = latency, 1.0 / rate  # seconds, seconds per byte
            self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of the points
            self.samples = 0

    @property
    def measured(self) -> bool:
        """Whether the estimate is worth planning on: measured, seeded, or a trusted first guess."""
        return self.trusted or self.samples > 0

    @property
    def rate(self) -> float:
        """Bytes/s once a request is under way."""
        return 1.0 / self._inverse

    @property
    def latency(self) -> float:
        """Seconds per request before its first byte."""
        return self._latency

    def seconds(self, nbytes: float) -> float:
        """How long a read of ``nbytes`` takes at the current estimate."""
        return self._latency + nbytes * self._inverse

    def seed(self, rate: float, latency: float, samples: int = 1) -> None:
        """Start from an earlier measurement (another process's, read back from disk)."""
        if not (rate > 0 and latency >= 0) or rate == float("inf") or latency == float("inf"):
            raise ValueError(f"a seed needs a finite rate > 0 and latency >= 0; got {rate!r}, {latency!r}")
        with self._lock:
            self._latency, self._inverse = float(latency), 1.0 / float(rate)
            self.samples = max(self.samples, int(samples), 1)

    def observe(self, nbytes: float, seconds: float) -> None:
        """Take one read: ``nbytes`` in ``seconds`` (ignored unless both are positive)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            keep = 1.0 - self.weight
            self._w = keep * self._w + self.weight
            self._x = keep * self._x + self.weight * nbytes
            self._y = keep * self._y + self.weight * seconds
            self._xx = keep * self._xx + self.weight * nbytes * nbytes
            self._xy = keep * self._xy + self.weight * nbytes * seconds
            self.samples += 1
            mx, my = self._x / self._w, self._y / self._w
            var = self._xx / self._w - mx * mx
            if self.samples >= 2 and var > (0.2 * mx) ** 2:  # sizes spread enough to fit a line
                slope = (self._xy / self._w - mx * my) / var
                latency = my - slope * mx
                if slope > 0 and 0 <= latency < my:
                    self._latency, self._inverse = latency, slope
                    return
            # one size (or a line that makes no sense): keep the latency, move seconds per byte
            per_byte = max(seconds - self._latency, 0.5 * seconds) / nbytes
            first = self.samples == 1  # the first read replaces the first guess outright
            self._inverse += (1.0 if first else self.weight) * (per_byte - self._inverse)
