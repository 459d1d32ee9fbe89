"""The fusion bench's prompt fitting."""

from __future__ import annotations

from ragkv.bench.fusion import fit_chunks


def test_fit_chunks_keeps_the_leading_chunks_that_fit_and_cuts_only_a_first_too_long_one():
    assert fit_chunks(2, [[1] * 3, [2] * 5, [3] * 5], 10) == [[1] * 3, [2] * 5]
    assert fit_chunks(2, [[1] * 5, [2] * 5], 10) == [[1] * 5]
    assert fit_chunks(2, [[1] * 20], 10) == [[1] * 8]
