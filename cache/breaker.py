"""``CircuitBreaker``: stop calling a tier that keeps failing, and try it again later."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Open after ``failures`` consecutive failures; after ``cooldown_s``, let one probe through.

    States: closed (calls pass), open (calls are skipped), half-open (one probe call passes;
    its success closes the circuit, its failure opens it for another cooldown).

    >>> now = [0.0]
    >>> b = CircuitBreaker(failures=2, cooldown_s=10, clock=lambda: now[0])
    >>> b.failure(), b.failure(), b.allow()
    (False, True, False)
    >>> now[0] = 11.0
    >>> b.allow(), b.allow()
    (True, False)
    >>> b.success(); b.state
    'closed'
    """

    def __init__(
        self, failures: int = 3, cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1 or cooldown_s < 0:
            raise ValueError("failures must be >= 1 and cooldown_s >= 0")
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None  # None: closed
        self._probing = False

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self._probing else "open"

    def allow(self) -> bool:
        """Whether a call may go to the tier now."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self._cooldown_s:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        """Record a call that worked: the circuit closes."""
        with self._lock:
            self._consecutive = 0
            self._opened_at = None
            self._probing = False

    def failure(self) -> bool:
        """Record a failed call. Returns True when this failure (re)opened the circuit."""
        with self._lock:
            self._consecutive += 1
            reopen = self._probing or (self._opened_at is None and self._consecutive >= self._threshold)
            self._probing = False
            if reopen:
                self._opened_at = self._clock()
            return reopen
