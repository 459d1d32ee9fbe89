"""Page-locked host memory carved into blocks of the size asked for: the host tier's allocator.

torch's pinned allocator rounds every allocation up to a power of two, so a 67 MB chunk of an 8B
model held 128 MB of page-locked memory, and a host tier of 16 GiB held about half of what it
could (docs/benchmarks.md, "GPU"). LMCache keeps one pinned pool with its own allocator for the
same reason. :class:`PinnedArena` takes segments from torch in powers of two (where its rounding
costs nothing), at most its capacity, and hands out blocks of them by first fit, rounded up to
512 bytes and merged with their free neighbours when they come back.

A block comes back when the last tensor viewing it is gone, not when its owner lets go: a request
that still reads an entry the tier has just evicted keeps the entry's memory whole until it is
done with it. Each block's tensor views a numpy array of its own, whose finalizer returns the block;
a finalizer only queues it (it may run on any thread, at any allocation), and the next call of the
arena takes the queue in under its lock. A DMA from a block is always waited for by the thread
that holds its tensor (``ragkv.gpu.feed``: the stager synchronizes its stream before it lets go of
its chunks), so a block never comes back under a copy.

Without CUDA the segments are plain host memory: the CPU tests run the same code.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ALIGN", "PinnedArena", "segment_sizes"]

ALIGN = 512  # bytes: blocks start on multiples of it (any dtype's alignment, whole cache lines)
MAX_SEGMENT = 1 << 30  # one cudaHostAlloc of 1 GiB takes a few hundred ms: made on the tier's worker thread
MIN_SEGMENT = 64 << 20  # what is left of the capacity below this is not allocated


def segment_sizes(capacity: int) -> list[int]:
    """The segments an arena of ``capacity`` bytes may take, largest first: powers of two, at most
    :data:`MAX_SEGMENT` each, while at least :data:`MIN_SEGMENT` of the capacity is left (the rest,
    under 64 MiB, is not taken). A capacity under :data:`MIN_SEGMENT` is one segment of its own size
    (torch's pinned allocator rounds that one up: a small tier's waste is small).

    >>> [s >> 20 for s in segment_sizes(2600 << 20)], segment_sizes(3000)
    ([1024, 1024, 512], [3000])
    """
    if capacity < MIN_SEGMENT:
        return [capacity] if capacity > 0 else []
    out: list[int] = []
    left = capacity
    while left >= MIN_SEGMENT:
        size = min(MAX_SEGMENT, 1 << (left.bit_length() - 1))
        out.append(size)
        left -= size
    return out


@dataclass(slots=True)
class _Segment:
    memory: torch.Tensor  # uint8, page-locked when the arena pins
    array: np.ndarray  # the same bytes as numpy: blocks are its slices
    free: list[tuple[int, int]]  # (offset, size) of free runs, sorted by offset, never adjacent


class PinnedArena:
    """Blocks of (page-locked) host memory, at most ``capacity`` bytes in all (see the module docstring).

    Args:
        capacity: bytes of segments the arena may take from torch.
        pin: page-locked segments (True needs CUDA).
    """

    def __init__(self, capacity: int, *, pin: bool) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.capacity, self.pin = capacity, pin
        self._sizes = segment_sizes(capacity)  # the segments still to take, largest first
        self.segment_sizes = tuple(self._sizes)  # every segment the arena may ever hold
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[int, int, int]] = collections.deque()  # appended by finalizers
        self._in_use = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of every segment the arena may take: its capacity, less what :func:`segment_sizes` leaves."""
        return sum(self.segment_sizes)

    def could_hold(self, sizes: list[int]) -> bool:
        """Whether blocks of ``sizes`` bytes could all be held at once in an empty arena (largest
        first into the segment with the most room left)."""
        room = sorted(self.segment_sizes, reverse=True)
        for size in sorted((self.block_size(n) for n in sizes), reverse=True):
            best = max(range(len(room)), key=lambda i: room[i], default=None)
            if best is None or room[best] < size:
                return False
            room[best] -= size
        return True

    @staticmethod
    def block_size(nbytes: int) -> int:
        """What a block of ``nbytes`` holds: rounded up to :data:`ALIGN`."""
        return -(-max(nbytes, 1) // ALIGN) * ALIGN

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` in a block of its own; None when no free run fits and no
        segment is left to take (free some blocks, then ask again)."""
        size = self.block_size(nbytes)
        with self._lock:
            self._take_returns()
            found = self._first_fit(size)
            take = self._sizes.pop(0) if found is None and self._sizes and size <= self._sizes[0] else 0
        if take:
            # a new segment (cudaHostAlloc of up to 1 GiB: hundreds of ms) is made outside the lock,
            # so lookups and stats never wait for it
            try:
                memory = torch.empty(take, dtype=torch.uint8, pin_memory=self.pin)
            except BaseException:
                with self._lock:  # not taken: its room stays available
                    self._sizes.append(take)
                    self._sizes.sort(reverse=True)
                raise
            with self._lock:
                self._segments.append(_Segment(memory, memory.numpy(), [(0, memory.numel())]))
                found = self._first_fit(size)
        with self._lock:
            if found is None:
                return None
            seg_index, offset = found
            self._in_use += size
            view = self._segments[seg_index].array[offset : offset + nbytes]
        weakref.finalize(view, self._returned.append, (seg_index, offset, size))
        return torch.from_numpy(view)

    def stats(self) -> dict[str, int]:
        """Bytes taken from torch (``segment_bytes``), in blocks (``block_bytes``), and the largest free run."""
        with self._lock:
            self._take_returns()
            runs = [size for seg in self._segments for _, size in seg.free] + self._sizes[:1]
            return {
                "segment_bytes": sum(s.memory.numel() for s in self._segments),
                "block_bytes": self._in_use,
                "largest_free": max(runs, default=0),
            }

    # ---- internals (the lock held) ---------------------------------------------------------
    def _first_fit(self, size: int) -> tuple[int, int] | None:
        for i, seg in enumerate(self._segments):
            for j, (offset, run) in enumerate(seg.free):
                if run >= size:
                    if run == size:
                        del seg.free[j]
                    else:
                        seg.free[j] = (offset + size, run - size)
                    return i, offset
        return None

    def _take_returns(self) -> None:
        while self._returned:
            seg_index, offset, size = self._returned.popleft()
            self._in_use -= size
            free = self._segments[seg_index].free
            j = bisect.bisect_left(free, (offset, 0))
            if j < len(free) and free[j][0] == offset + size:  # merge with the run after it
                size += free[j][1]
                del free[j]
            if j > 0 and free[j - 1][0] + free[j - 1][1] == offset:  # and with the run before it
                offset, size = free[j - 1][0], free[j - 1][1] + size
                del free[j - 1]
                j -= 1
            free.insert(j, (offset, size))
