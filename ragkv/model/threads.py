"""How many threads torch's CPU kernels use, chosen from the cores other processes leave free.

On a CPU shared with other work, an intra-op thread that loses its core holds up every other
thread at the next barrier: measured on 2 cores next to one busy process, a decode token took
2.47 s with torch's default 2 threads against 0.21 s with 1. ``ThreadPolicy`` samples the
machine's busy time (``/proc/stat``) minus this process's own (``os.times``) over the last
interval, and uses the cores the others leave free (at least one).

``RAGKV_THREADS`` sets the policy: ``auto`` (the default: adapt as above), an integer (that many
threads, fixed), or ``torch`` (leave torch's setting alone). Only Linux exposes ``/proc/stat``;
elsewhere ``auto`` keeps torch's setting.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["ADAPT_EVERY_STEPS", "ThreadPolicy", "adapt_threads", "policy_from_env"]

ADAPT_EVERY_STEPS = 16  # decode steps between looks at the machine's load (each look is cheap)

_STAT = "/proc/stat"
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are free time)


def _machine_busy_s() -> float | None:
    """Seconds of CPU time all processes used since boot (None where /proc/stat is missing)."""
    try:
        with open(_STAT, encoding="ascii") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    t = os.times()
    return t.user + t.system


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class _Sample:
    wall: float
    machine: float
    own: float


class ThreadPolicy:
    """Chooses torch's intra-op thread count: fixed, or adapted to the other processes' load.

    Args:
        fixed: a thread count to keep (None: adapt).
        max_threads: the most threads to use when adapting (default: torch's thread count when
            the policy is made, which is the machine's cores unless the caller set it lower).
        interval_s: the shortest window a load reading covers; :meth:`apply` called sooner
            keeps the last choice.
    """

    def __init__(self, fixed: int | None = None, max_threads: int | None = None, interval_s: float = 1.0) -> None:
        if fixed is not None and fixed < 1:
            raise ValueError(f"a fixed thread count must be >= 1, got {fixed}")
        self.fixed = fixed
        self.max_threads = max(1, max_threads or min(torch.get_num_threads(), _cores()))
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: _Sample | None = None
        self._chosen: int | None = fixed
        self.others_busy: float | None = None  # cores the other processes kept busy over the last window

    def choose(self, machine_busy_s: float, own_busy_s: float, wall_s: float) -> int:
        """The thread count for one reading (cumulative machine and own CPU seconds at ``wall_s``).

        The first reading only starts the window (the current choice stays); later readings at
        least ``interval_s`` apart give ``others = d(machine) - d(own)`` busy cores over the
        window, and ``max(1, min(max_threads, floor(max_threads - others + 0.3)))`` threads.
        """
        if self.fixed is not None:
            return self.fixed
        sample = _Sample(wall_s, machine_busy_s, own_busy_s)
        last = self._last
        if last is None:
            self._last = sample
            return self._chosen or self.max_threads
        span = wall_s - last.wall
        if span < self.interval_s:
            return self._chosen or self.max_threads
        self._last = sample
        others = max(0.0, ((machine_busy_s - last.machine) - (own_busy_s - last.own)) / span)
        self.others_busy = others
        self._chosen = max(1, min(self.max_threads, math.floor(self.max_threads - others + 0.3)))
        return self._chosen

    def apply(self) -> int:
        """Set torch's thread count to this policy's choice now; return it."""
        with self._lock:
            if self.fixed is not None:
                n = self.fixed
            elif self._last is not None and time.monotonic() - self._last.wall < self.interval_s:
                n = self._chosen or self.max_threads  # within the window: no reading
            else:
                busy = _machine_busy_s()
                if busy is None:
                    return torch.get_num_threads()
                n = self.choose(busy, _own_busy_s(), time.monotonic())
        if n != torch.get_num_threads():
            logger.debug(
                "torch threads %d -> %d (other processes busy on %s cores)",
                torch.get_num_threads(),
                n,
                "?" if self.others_busy is None else f"{self.others_busy:.2f}",
            )
            torch.set_num_threads(n)
        return n


def policy_from_env(value: str | None = None) -> ThreadPolicy | None:
    """The policy ``RAGKV_THREADS`` (or ``value``) names; None for ``torch`` (leave threads alone)."""
    raw = (os.environ.get("RAGKV_THREADS", "auto") if value is None else value).strip().lower()
    if raw in ("", "auto"):
        return ThreadPolicy()
    if raw == "torch":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"RAGKV_THREADS must be 'auto', 'torch' or a thread count >= 1; got {raw!r}")
    return ThreadPolicy(fixed=n)


_policy: ThreadPolicy | None = None
_policy_read = False
_policy_lock = threading.Lock()


def adapt_threads() -> int:
    """Apply the process's policy (``RAGKV_THREADS``, read once) before a forward-heavy step; return the count."""
    global _policy, _policy_read
    with _policy_lock:
        if not _policy_read:
            _policy, _policy_read = policy_from_env(), True
    return _policy.apply() if _policy is not None else torch.get_num_threads()
