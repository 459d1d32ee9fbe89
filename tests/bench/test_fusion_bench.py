"""The fusion bench's prompt fitting."""

from __future__ import annotations

import pytest

from ragkv.bench.fusion import fit_chunks, parse_grid


def test_fit_chunks_keeps_the_leading_chunks_that_fit_and_cuts_only_a_first_too_long_one():
    assert fit_chunks(2, [[1] * 3, [2] * 5, [3] * 5], 10) == [[1] * 3, [2] * 5]
    assert fit_chunks(2, [[1] * 5, [2] * 5], 10) == [[1] * 5]
    assert fit_chunks(2, [[1] * 20], 10) == [[1] * 8]


def test_the_grid_names_shipped_methods_or_fails_before_any_model_loads():
    assert parse_grid("naive,blend:0.15,query_focus:0.2,full:1") == [
        ("naive", 0.0),
        ("blend", 0.15),
        ("query_focus", 0.2),
        ("full", 1.0),
    ]
    with pytest.raises(ValueError, match="unknown fusion method 'query_gradual'"):
        parse_grid("naive,query_gradual:0.15")
    with pytest.raises(ValueError, match="ratio"):
        parse_grid("blend:1.5")
