"""PinnedArena: blocks of the size asked, first fit, merged when they come back, never reused under a reader."""

from __future__ import annotations

import gc

import pytest
import torch

from ragkv.gpu.arena import ALIGN, MAX_SEGMENT, MIN_SEGMENT, PinnedArena, segment_sizes


def test_segments_are_powers_of_two_up_to_the_capacity() -> None:
    assert segment_sizes(0) == [] and segment_sizes(5000) == [5000]
    assert segment_sizes(16 << 30) == [MAX_SEGMENT] * 16
    sizes = segment_sizes((2 << 30) + (100 << 20))
    assert sizes == [MAX_SEGMENT, MAX_SEGMENT, 64 << 20]  # 36 MiB left: under MIN_SEGMENT, not taken
    assert all(s >= MIN_SEGMENT and s & (s - 1) == 0 for s in sizes)


def test_blocks_are_exact_views_that_do_not_overlap() -> None:
    arena = PinnedArena(64 * ALIGN, pin=False)
    blocks = [arena.alloc(n) for n in (1, ALIGN, ALIGN + 1, 3 * ALIGN)]
    assert all(b is not None for b in blocks)
    assert [b.numel() for b in blocks] == [1, ALIGN, ALIGN + 1, 3 * ALIGN]  # type: ignore[union-attr]
    starts = [b.data_ptr() for b in blocks]  # type: ignore[union-attr]
    assert all(s % ALIGN == starts[0] % ALIGN for s in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert starts == sorted(starts) and gaps == [ALIGN, ALIGN, 2 * ALIGN]
    for i, b in enumerate(blocks):
        b.fill_(i)  # type: ignore[union-attr]
    assert [int(b[0]) for b in blocks] == [0, 1, 2, 3] and [int(b[-1]) for b in blocks] == [0, 1, 2, 3]  # type: ignore[index]
    assert arena.stats()["block_bytes"] == 7 * ALIGN


def test_a_block_comes_back_only_when_its_last_view_is_gone_and_merges_with_its_neighbours() -> None:
    arena = PinnedArena(4 * ALIGN, pin=False)
    a, b, c, d = (arena.alloc(ALIGN) for _ in range(4))
    assert arena.alloc(1) is None  # full
    held = b.view(torch.float16)[:10]  # type: ignore[union-attr]  # a reader's view of b
    del b
    gc.collect()
    assert arena.alloc(1) is None  # b is still read: not free
    del held, c
    assert arena.stats()["largest_free"] == 2 * ALIGN  # b and c came back, merged into one run
    two = arena.alloc(2 * ALIGN)
    assert two is not None and arena.alloc(1) is None
    del a, d, two
    assert arena.stats() == {"segment_bytes": 4 * ALIGN, "block_bytes": 0, "largest_free": 4 * ALIGN}
    whole = arena.alloc(4 * ALIGN)  # every run merged back into the segment
    assert whole is not None and whole.numel() == 4 * ALIGN


def test_first_fit_takes_the_earliest_run_that_fits() -> None:
    arena = PinnedArena(8 * ALIGN, pin=False)
    blocks = [arena.alloc(ALIGN) for _ in range(8)]
    first = blocks[1].data_ptr()  # type: ignore[union-attr]
    blocks[1] = blocks[4] = blocks[5] = None  # free runs: [1] and [4, 5]
    big = arena.alloc(2 * ALIGN)
    small = arena.alloc(ALIGN)
    assert big is not None and small is not None and small.data_ptr() == first
    assert big.data_ptr() == first + 3 * ALIGN


def test_segments_are_taken_when_needed_and_never_past_the_capacity() -> None:
    arena = PinnedArena(5000, pin=False)
    assert arena.stats()["segment_bytes"] == 0  # nothing taken before the first block
    assert arena.segment_sizes == (5000,)
    assert arena.alloc(5001) is None  # larger than any segment
    x = arena.alloc(4000)
    assert x is not None and arena.stats()["segment_bytes"] == 5000
    assert arena.alloc(1500) is None  # 1,000 bytes left, rounded blocks of 512: one fits, not 1,500
    assert arena.alloc(500) is not None


def test_capacity_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        PinnedArena(-1, pin=False)


def test_a_segment_that_cannot_be_made_stays_available(monkeypatch) -> None:
    from ragkv.gpu import arena as arena_mod

    arena = PinnedArena(4 * ALIGN, pin=False)
    real = torch.empty

    def no_memory(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(arena_mod.torch, "empty", no_memory)
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        arena.alloc(ALIGN)
    monkeypatch.setattr(arena_mod.torch, "empty", real)
    assert arena.alloc(4 * ALIGN) is not None  # the segment was not lost


def test_could_hold_places_blocks_in_the_segments() -> None:
    arena = PinnedArena(MAX_SEGMENT + MAX_SEGMENT // 2, pin=False)  # segments of 1 GiB and 512 MiB
    assert arena.segment_sizes == (MAX_SEGMENT, MAX_SEGMENT // 2)
    assert arena.could_hold([600 << 20, 400 << 20])  # one in each segment
    assert not arena.could_hold([600 << 20, 600 << 20])  # only one segment fits 600 MiB
    assert not arena.could_hold([MAX_SEGMENT + 1])
    assert arena.stats()["segment_bytes"] == 0  # asking takes nothing
