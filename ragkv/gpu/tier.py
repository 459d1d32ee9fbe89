"""The device tier: decoded chunk caches kept in GPU memory, shared by every request of the process.

A hit is a chunk's K/V already on the model's device in its dtype: no host memory, no decode, no
PCIe copy. Entries are keyed exactly as the store (the storage key digests the model, tokenizer,
prefix, tokens, codec and level, transform and tenant, so tenants never share one) and hold what
a use must match besides: the model fingerprint, dtype, device and token count. Anything else is
a miss, and the entry goes. Entries are what decoding the stored bytes gave (never a chunk's
recomputed K/V), so a device hit fuses exactly as a store hit would.

Bounded in bytes; evicted by recency and cost (GreedyDual-Size: an entry's priority is the clock
at its last use plus its load cost in seconds per GiB; the lowest goes first and the clock rises
to it), so an entry that was slow to load (a remote tier, an entropy-coded level) outlives a
cheap one used as recently. A device that runs out of memory evicts (:func:`release`) before the
request that needed the memory gives up.

The bookkeeping (budget, GreedyDual-Size order, counters, the lock) is :class:`BoundedTier`, which
the host tier (``ragkv.gpu.host_tier``) shares.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ragkv.gpu.feed import DeviceSink, _uses_streams
from ragkv.gpu.graphs import CAPTURE_LOCK
from ragkv.types import ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["BoundedTier", "DeviceTier", "DeviceTierConfig", "release"]

_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class DeviceTierConfig:
    """How much device memory the tier may hold."""

    budget_bytes: int | None = None  # None: `fraction` of the device's free memory at start; 0: off
    fraction: float = 0.3  # share of free device memory when budget_bytes is None (a CPU model: off)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 (0 turns the device tier off), got {self.budget_bytes}")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1) of free device memory, got {self.fraction}")

    def budget_for(self, device: torch.device) -> int:
        """The byte budget on ``device``: the explicit one, else a share of free memory on a GPU (0 elsewhere)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        if device.type != "cuda":
            return 0  # host memory has its own tier (memory://); a CPU model needs no copy of it
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * self.fraction)


@dataclass(slots=True)
class _Entry:
    kv: ChunkKV
    nbytes: int  # what the entry costs the budget
    cost_per_gib: float  # load seconds per GiB: GreedyDual-Size's cost over size
    priority: float
    used: int  # use counter at the last use: breaks ties between equal priorities, least recent first
    # on a GPU: an event recorded after the entry's writes, and the stream they ran on (a reader on
    # another stream waits for the event)
    written: tuple[torch.cuda.Event, torch.cuda.Stream] | None = None

    def rank(self) -> tuple[float, int]:
        return self.priority, self.used


class BoundedTier:
    """Chunk caches by storage key, at most ``budget_bytes`` of them, evicted by GreedyDual-Size.

    Thread-safe: every method takes the tier's lock. Subclasses say where entries live and how
    they get in; lookups go through :meth:`_lookup`, admissions through :meth:`_insert`.
    """

    name = "tier"  # how log lines name it

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: dict[str, _Entry] = {}
        self._pending = 0  # bytes reserved by entries still being filled
        self._clock = 0.0
        self._uses = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.refused = 0

    def _lookup(self, key: str, usable: Callable[[ChunkKV], bool]) -> ChunkKV | None:
        """The entry under ``key`` if ``usable`` says so; else None (a miss, and a foreign entry goes)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            if not usable(entry.kv):
                logger.warning("%s entry %s is for another model, dtype, device or length; dropped", self.name, key)
                self._drop(key)
                self.misses += 1
                return None
            entry.priority = self._clock + entry.cost_per_gib
            self._uses += 1
            entry.used = self._uses
            self.hits += 1
        self._served(entry)  # outside the lock: it may call into CUDA (the caller holds the entry)
        return entry.kv

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def discard(self, key: str) -> bool:
        """Forget ``key`` (its document was removed, or its stored entry found unusable)."""
        with self._lock:
            return self._drop(key)

    def clear(self) -> int:
        """Forget every entry; the bytes freed."""
        with self._lock:
            freed = sum(e.nbytes for e in self._entries.values())
            self._entries.clear()
            return freed

    def stats(self) -> dict[str, int | str]:
        """Entries, bytes held and pending, the budget, and the counters."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": sum(e.nbytes for e in self._entries.values()),
                "pending_bytes": self._pending,
                "budget_bytes": self.budget_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "refused": self.refused,
            }

    def keys(self) -> list[str]:
        """The keys held, the next to be evicted first."""
        with self._lock:
            return [k for k, _ in sorted(self._entries.items(), key=lambda item: item[1].rank())]

    def _served(self, entry: _Entry) -> None:
        """``entry`` is handed to a reader, the lock not held (the device tier orders the reader's
        stream after the entry's writes)."""

    # ---- internals (the lock held) ---------------------------------------------------------

    def _insert(self, key: str, kv: ChunkKV, nbytes: int, cost_s: float) -> bool:
        """Keep ``kv`` under ``key``, evicting as needed; False if it can never fit."""
        if not self._make_room(nbytes, key):
            return False
        self._entries[key] = self._entry(kv, nbytes, cost_s)
        return True

    def _entry(self, kv: ChunkKV, nbytes: int, cost_s: float) -> _Entry:
        cost = max(cost_s, 0.0) / max(nbytes / _GIB, 1e-9)
        self._uses += 1
        return _Entry(kv, nbytes, cost, self._clock + cost, self._uses)

    def _make_room(self, nbytes: int, key: str) -> bool:
        """Evict the lowest-priority entries until ``nbytes`` more fit; False (nothing evicted) if they never can."""
        if nbytes > self.budget_bytes - self._pending:
            self.refused += 1
            return False
        self._drop(key)
        used = sum(e.nbytes for e in self._entries.values()) + self._pending
        while used + nbytes > self.budget_bytes and self._entries:
            used -= self._evict_lowest()
        return True

    def _evict_lowest(self) -> int:
        """Evict the entry GreedyDual-Size would evict next; the bytes it held (0: there was none)."""
        if not self._entries:
            return 0
        victim = min(self._entries, key=lambda k: self._entries[k].rank())
        self._clock = self._entries[victim].priority  # GreedyDual: the clock rises to the evicted priority
        nbytes = self._entries[victim].nbytes
        self._drop(victim)
        self.evictions += 1
        return nbytes

    def _drop(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None


_TIERS: weakref.WeakSet[DeviceTier] = weakref.WeakSet()


def release(device: torch.device) -> int:
    """Drop every device tier entry on ``device`` (out of memory); the bytes freed."""
    freed = sum(tier.clear() for tier in list(_TIERS) if tier.device == device)
    if device.type == "cuda":
        with CAPTURE_LOCK:  # not while a CUDA graph is captured: the allocator forbids it
            torch.cuda.empty_cache()
    return freed


class DeviceTier(BoundedTier):
    """Decoded chunk caches on one device, at most ``budget_bytes`` of them (see the module docstring)."""

    name = "device tier"

    def __init__(self, budget_bytes: int, device: torch.device | str) -> None:
        super().__init__(budget_bytes)
        self.device = torch.device(device)
        # open reservations by key: a discard closes its key's, so a sink filled after its
        # document's removal never becomes an entry
        self._reserved: dict[str, dict[str, Any]] = {}
        # reservations whose sinks were collected while the lock was taken (see _abandon)
        self._abandoned: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        _TIERS.add(self)

    def discard(self, key: str) -> bool:
        """Forget ``key``, and close a reservation of it still being filled (it is then never served)."""
        with self._lock:
            state = self._reserved.get(key)
            if state is not None:
                self._close(key, state)
            return self._drop(key) or state is not None

    def get(self, key: str, *, fingerprint: str, dtype: torch.dtype, num_tokens: int) -> ChunkKV | None:
        """The entry under ``key`` if it is for this model, dtype, device and length; else None (and it goes)."""

        def usable(kv: ChunkKV) -> bool:
            return (
                kv.model_fingerprint == fingerprint
                and kv.keys.dtype == dtype
                and kv.keys.device == self.device
                and kv.num_tokens == num_tokens
            )

        return self._lookup(key, usable)

    def put(self, key: str, kv: ChunkKV, cost_s: float) -> bool:
        """Keep ``kv`` (already on this device; kept by reference, never written) under ``key``.

        On a GPU its writes are those queued so far on the caller's current stream (a decode's
        uploads): a reader on another stream waits for them (see :meth:`_served`)."""
        if kv.keys.device != self.device:
            raise ValueError(f"device tier on {self.device} got a chunk cache on {kv.keys.device}")
        nbytes = _nbytes(kv)
        written = self._written()  # before the lock: CUDA calls never run under it
        with self._lock:
            self._take_abandoned()  # their bytes count as pending until then
            if not self._insert(key, kv, nbytes, cost_s):
                return False
            self._entries[key].written = written
            return True

    def reserve(self, key: str, like: ChunkKV, dtype: torch.dtype, cost_s: float) -> DeviceSink | None:
        """Device tensors for ``like`` (a host chunk) to be filled as it is staged; the entry is served
        once the sink is filled (a sink dropped unfilled frees its reservation). None: no room."""
        shape, nbytes = tuple(like.keys.shape), 2 * like.keys.numel() * torch.empty(0, dtype=dtype).element_size()
        state: dict[str, Any] = {"open": True, "nbytes": nbytes}
        with self._lock:
            self._take_abandoned()
            if key in self._entries or key in self._reserved or not self._make_room(nbytes, key):
                return None
            self._pending += nbytes
            self._reserved[key] = state
        try:
            keys = torch.empty(shape, dtype=dtype, device=self.device)
            values = torch.empty(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError:
            with self._lock:
                self._close(key, state)
                self.refused += 1
            logger.info("device tier: no device memory for %s; served from host memory", key)
            return None
        kv = ChunkKV(keys, values, like.positions.clone(), like.model_fingerprint)

        def filled() -> None:  # on the thread that filled the sink, its copies queued on its stream
            written = self._written()
            with self._lock:
                if self._close(key, state):
                    entry = self._entries[key] = self._entry(kv, nbytes, cost_s)
                    entry.written = written

        sink = DeviceSink(keys, values, filled)
        weakref.finalize(sink, self._abandon, key, state)
        return sink

    def _written(self) -> tuple[torch.cuda.Event, torch.cuda.Stream] | None:
        """An event after the work queued so far on the current stream, and that stream (on a GPU;
        None elsewhere)."""
        if not _uses_streams(self.device):
            return None
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return event, stream

    def _served(self, entry: _Entry) -> None:
        # A request on another stream than the one that wrote the entry (callers running requests
        # on streams of their own) must not read it before those writes ran, and an eviction must
        # not give its memory back to the writer's stream while this reader's kernels use it.
        if entry.written is None:
            return
        event, writer = entry.written
        reader = torch.cuda.current_stream(self.device)
        if reader == writer:  # the usual case: one stream, already in order
            return
        reader.wait_event(event)
        entry.kv.keys.record_stream(reader)
        entry.kv.values.record_stream(reader)

    def _abandon(self, key: str, state: dict[str, Any]) -> None:
        # A finalizer: it runs where the sink is collected, on any thread, at any allocation, so
        # perhaps inside this tier's lock on this very thread (a sink in a reference cycle, such as
        # an exception's traceback, collected by the cycle collector): waiting for the lock there
        # would never end. Closed now if the lock is free, else by the next put, reservation or
        # stats().
        if not self._lock.acquire(blocking=False):
            self._abandoned.append((key, state))
            return
        try:
            self._take_abandoned()
            self._close(key, state)
        finally:
            self._lock.release()

    def _take_abandoned(self) -> None:
        """Close the reservations abandoned while the lock was taken (the lock held)."""
        while self._abandoned:
            self._close(*self._abandoned.popleft())

    def _close(self, key: str, state: dict[str, Any]) -> bool:
        """End reservation ``state`` of ``key`` (the lock held); True if it was still open."""
        if self._reserved.get(key) is state:
            del self._reserved[key]
        if not state["open"]:
            return False
        state["open"] = False
        self._pending -= state["nbytes"]
        return True

    def stats(self) -> dict[str, int | str]:
        """The device, entries, bytes held and pending, the budget, and the counters."""
        with self._lock:
            self._take_abandoned()
        return {"device": str(self.device), **super().stats()}


def _nbytes(kv: ChunkKV) -> int:
    return (kv.keys.numel() + kv.values.numel()) * kv.keys.element_size()
