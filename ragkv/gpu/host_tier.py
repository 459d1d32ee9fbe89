"""The host tier: decoded chunk caches kept in page-locked host memory, behind the device tier.

For a model on a GPU, a chunk read from the store costs its decode (for raw chunks mostly the
payload checksum, on one thread) and a staging copy through pinned slabs; the same chunk already
decoded in page-locked memory crosses PCIe straight from where it is by DMA, a copy that hides
under the compute (``ragkv.gpu.feed``: ``_cross_direct``). This tier keeps such chunks: what
decoding the stored bytes gave (for raw chunks the fp16 the loader stages; for others the model's
dtype, copied back from the device), never a chunk recomputed at query time, so a host hit fuses
exactly as a store hit would. LMCache keeps a pinned CPU pool in front of its slower tiers the
same way.

Lookups and eviction are the device tier's (:class:`~ragkv.gpu.tier.BoundedTier`: keyed by the
storage key, so tenants never share an entry; a hit must match the model fingerprint, dtype and
token count, anything else is a miss and the entry goes; GreedyDual-Size within a byte budget).
It is a class of its own rather than a mode of :class:`~ragkv.gpu.tier.DeviceTier` because
entries get in another way: a device entry is kept by reference or filled by fusion as its chunk
lands, while a host entry is a copy into memory the tier allocates, made by a worker thread
(:meth:`HostTier.offer`) so that the copy (~10 GB/s, ~0.2 s for a 16K-token prompt of an 8B
model) never sits on a request's path. A mode flag would have put a branch in every method.

Memory: entries live in blocks of the tier's own arena (:class:`~ragkv.gpu.arena.PinnedArena`:
page-locked segments taken from torch in powers of two, carved by first fit), so an entry costs the
budget its size rounded up to 512 bytes. torch's pinned allocator, used for each entry before, rounded
every one up to a power of two: a 67 MB chunk held 128 MB. When no free run fits, the tier evicts
(GreedyDual-Size order) until one does; a block comes back once no request reads it any more.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

from ragkv.gpu.arena import PinnedArena
from ragkv.gpu.tier import BoundedTier
from ragkv.types import ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["HostTier", "HostTierConfig", "available_memory"]

_IDLE_S = 2.0  # the worker ends after this long without an admission (the next one starts it again)


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    """How much page-locked host memory the tier may hold."""

    budget_bytes: int | None = None  # None: `fraction` of available RAM, at most `max_bytes` (a GPU model); 0: off
    fraction: float = 0.25  # share of the machine's available RAM when budget_bytes is None
    max_bytes: int = 16 << 30  # cap on that share: page-locked memory is never swapped, the OS needs the rest
    queue_size: int = 64  # admissions waiting for the copy worker; more are dropped (the chunk stays in the store)

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 (0 turns the host tier off), got {self.budget_bytes}")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1) of available host memory, got {self.fraction}")
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 admission, got {self.queue_size}")

    def budget_for(self, device: torch.device) -> int:
        """The byte budget for a model on ``device``: the explicit one, else a capped share of available
        RAM on a GPU (0 elsewhere: a CPU model reads host memory already, memory:// holds it)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        if device.type != "cuda":
            return 0
        return min(int(available_memory() * self.fraction), self.max_bytes)


def available_memory() -> int:
    """Bytes of RAM the machine can give without swapping: Linux's MemAvailable (free memory plus
    reclaimable caches), else the free pages ``os.sysconf`` counts; 0 if neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(slots=True)
class _Offer:
    key: str
    kv: ChunkKV  # held until copied: a device source cannot be freed and reused under the copy
    cost_s: float  # what loading it cost (GreedyDual-Size's cost)
    ticket: int  # the admission's number: a discard in the meantime cancels it
    ready: torch.cuda.Event | None  # a device source: recorded after its decode, the copy waits for it


def _work(ref: weakref.ReferenceType[HostTier], jobs: queue.Queue[_Offer]) -> None:
    """The copy worker of the tier ``ref`` names, holding it only while it lands an admission.

    A thread whose target held the tier (a bound method) dropped it when the thread ended; if that
    was the tier's last reference while the interpreter was exiting, its tensors were freed on a
    thread Python was tearing down, and torch's destructor, taking the GIL there, aborted the
    process ("terminate called without an active exception", about 1 run in 6-8 of the host
    tier's tests). So the tier is held weakly, and not at all while the worker waits.
    """
    while True:
        try:
            offer = jobs.get(timeout=_IDLE_S)
        except queue.Empty:
            tier = ref()
            if tier is None or tier._idle():
                return
            del tier
            continue
        tier = ref()
        try:
            if tier is not None:
                tier._serve(offer)
        finally:
            del tier, offer
            jobs.task_done()


class HostTier(BoundedTier):
    """Decoded chunk caches in (page-locked) host memory, at most ``budget_bytes`` (see the module docstring).

    Args:
        budget_bytes: bytes the entries may hold (their arena blocks). The arena takes segments of
            powers of two up to it; a rest under 64 MiB is not taken, and the tier's budget is what the
            segments hold (``ragkv.gpu.arena.segment_sizes``).
        pin: page-locked entries (default: when CUDA is available; a CPU has no pinned memory).
        queue_size: admissions waiting for the copy worker; an offer beyond them is dropped.
    """

    name = "host tier"

    def __init__(self, budget_bytes: int, *, pin: bool | None = None, queue_size: int = 64) -> None:
        arena = PinnedArena(budget_bytes, pin=torch.cuda.is_available() if pin is None else pin)
        super().__init__(arena.total_bytes)  # what the arena can really hold (at most budget_bytes)
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 admission, got {queue_size}")
        self.pin, self._arena = arena.pin, arena
        self._queue: queue.Queue[_Offer] = queue.Queue(maxsize=queue_size)
        self._offered: dict[str, int] = {}  # key -> ticket of its admission waiting for the worker
        self._tickets = 0
        self._worker: threading.Thread | None = None
        self.dropped = 0

    def get(self, key: str, *, fingerprint: str, dtype: torch.dtype, num_tokens: int) -> ChunkKV | None:
        """The entry under ``key`` if it is for this model, dtype and length; else None (and it goes)."""

        def usable(kv: ChunkKV) -> bool:
            return (
                kv.model_fingerprint == fingerprint
                and kv.keys.dtype == dtype
                and kv.values.dtype == dtype
                and kv.num_tokens == num_tokens
            )

        return self._lookup(key, usable)

    # ---- admissions ------------------------------------------------------------------------
    def offer(self, key: str, kv: ChunkKV, cost_s: float) -> bool:
        """Queue ``kv`` (never written) to be copied into the tier by the worker thread, off the
        request's path. False: not queued (held or queued already, too big, or the queue is full:
        dropped, and the chunk stays where it was read from)."""
        nbytes = self._footprint(kv)
        with self._lock:
            if key in self._entries or key in self._offered:
                return False
            if not self._fits(kv, nbytes):
                self.refused += 1
                return False
            ready = None
            if kv.keys.device.type == "cuda":  # the copy runs on a stream of its own, after the decode
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(kv.keys.device))
            self._tickets += 1
            try:
                self._queue.put_nowait(_Offer(key, kv, cost_s, self._tickets, ready))
            except queue.Full:
                self.dropped += 1
                return False
            self._offered[key] = self._tickets
            if self._worker is None:  # started per burst of admissions; it ends when idle
                # the thread holds the tier weakly (see _work): never the last reference to it
                args = (weakref.ref(self), self._queue)
                self._worker = threading.Thread(target=_work, args=args, name="ragkv-host-tier", daemon=True)
                self._worker.start()
        return True

    def put(self, key: str, kv: ChunkKV, cost_s: float) -> bool:
        """Copy ``kv`` into the tier now, on the caller's thread; False: it can never fit.

        Raises:
            MemoryError: no block is free even with the tier emptied (requests still read them).
        """
        nbytes = self._footprint(kv)
        with self._lock:
            if not self._fits(kv, nbytes):
                self.refused += 1
                return False
        copy = self._copy(kv, None)
        with self._lock:
            self._offered.pop(key, None)  # this copy supersedes one in the queue
            return self._insert(key, copy, nbytes, cost_s)

    def drain(self) -> None:
        """Wait until every queued admission is in (or dropped): tests, benchmarks, shutdown."""
        self._queue.join()

    # ---- removal ---------------------------------------------------------------------------
    def discard(self, key: str) -> bool:
        """Forget ``key``, and cancel its admission if one waits for the worker."""
        with self._lock:
            cancelled = self._offered.pop(key, None) is not None
            return self._drop(key) or cancelled

    def clear(self) -> int:
        """Forget every entry and cancel the waiting admissions; the bytes freed."""
        with self._lock:
            self._offered.clear()
            freed = sum(e.nbytes for e in self._entries.values())
            self._entries.clear()
            return freed

    def stats(self) -> dict[str, int | str]:
        """Where entries live, entries, bytes held, the budget, and the counters (``dropped``: offers
        the full queue turned away; ``queued``: admissions waiting for the worker)."""
        base = super().stats()
        base.pop("pending_bytes")  # nothing is reserved ahead: an admission takes room when it lands
        with self._lock:
            queued = len(self._offered)
        arena = self._arena.stats()  # segments taken, blocks in use (evicted entries a request still reads too)
        return {
            "memory": "pinned" if self.pin else "pageable",
            **base,
            "queued": queued,
            "dropped": self.dropped,
            "arena_bytes": arena["segment_bytes"],
            "arena_block_bytes": arena["block_bytes"],
        }

    # ---- the worker ------------------------------------------------------------------------
    def _idle(self) -> bool:
        """The worker found no admission for a while: True if it ends (none waits)."""
        with self._lock:  # an offer puts under this lock: none can be left without a worker
            if self._queue.empty():
                self._worker = None
                return True
            return False

    def _serve(self, offer: _Offer) -> None:
        try:
            self._land(offer)
        except Exception as e:  # a failed copy (no pinned memory left) is only a missed admission
            logger.warning("host tier: could not keep %s (%s); it stays in the store", offer.key, e)
            with self._lock:
                if self._offered.get(offer.key) == offer.ticket:
                    del self._offered[offer.key]
                self.refused += 1

    def _land(self, offer: _Offer) -> None:
        with self._lock:
            if self._offered.get(offer.key) != offer.ticket:
                return  # discarded (its document removed) before the worker got to it
        copy = self._copy(offer.kv, offer.ready)
        with self._lock:
            # checked again: a discard while the copy ran wins, so a removed chunk never gets in
            if self._offered.get(offer.key) != offer.ticket:
                return
            del self._offered[offer.key]
            self._insert(offer.key, copy, self._footprint(copy), offer.cost_s)

    def _copy(self, kv: ChunkKV, ready: torch.cuda.Event | None) -> ChunkKV:
        """``kv`` copied into memory of this tier (page-locked when ``pin``), in its dtype and layout."""
        with torch.no_grad():
            keys, values = self._block(kv.keys), self._block(kv.values)
            if kv.keys.device.type == "cuda":
                # not on the compute stream: a copy queued there would delay the next request's kernels
                stream = torch.cuda.Stream(kv.keys.device)
                if ready is not None:
                    stream.wait_event(ready)
                else:
                    stream.wait_stream(torch.cuda.current_stream(kv.keys.device))
                with torch.cuda.stream(stream):
                    keys.copy_(kv.keys, non_blocking=self.pin)
                    values.copy_(kv.values, non_blocking=self.pin)
                stream.synchronize()
            else:
                keys.copy_(kv.keys)
                values.copy_(kv.values)
        return ChunkKV(keys, values, kv.positions.clone(), kv.model_fingerprint)

    def _block(self, like: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped as ``like``, in a block of the arena; entries are evicted until one fits.

        Raises:
            MemoryError: no block fits even with the tier empty (its blocks are still read by requests).
        """
        nbytes = like.numel() * like.element_size()
        evicted = 0
        while (block := self._arena.alloc(nbytes)) is None:
            with self._lock:
                # an evicted entry a request still reads frees nothing yet: give up after evicting
                # a few times the room needed rather than emptying the tier
                freed = self._evict_lowest() if evicted <= 4 * nbytes else 0
                if not freed:
                    raise MemoryError(f"{self.name}: no free block of {nbytes} bytes (the rest is still being read)")
                evicted += freed
        return block.view(like.dtype).view(like.shape)

    def _fits(self, kv: ChunkKV, nbytes: int) -> bool:
        """Whether ``kv`` could ever be held: within the budget, its two blocks in the arena's segments."""
        sizes = [t.numel() * t.element_size() for t in (kv.keys, kv.values)]
        return nbytes <= self.budget_bytes and self._arena.could_hold(sizes)

    def _footprint(self, kv: ChunkKV) -> int:
        return sum(self._arena.block_size(t.numel() * t.element_size()) for t in (kv.keys, kv.values))
