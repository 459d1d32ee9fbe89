"""ragkv.bench.table: the one formatter every bench prints its rows with."""

from __future__ import annotations

import pytest

from ragkv.bench import assemble, codec, fusion, store
from ragkv.bench.table import Column, format_table


def test_numbers_right_aligned_text_left() -> None:
    rows = [{"tier": "memory://", "get_mb_s": 1.5, "n": 3}, {"tier": "x", "get_mb_s": 10.0, "n": 12}]
    assert format_table(rows).splitlines() == [
        "| tier      | get_mb_s |  n |",
        "|-----------|---------:|---:|",
        "| memory:// |      1.5 |  3 |",
        "| x         |     10.0 | 12 |",
    ]


def test_columns_choose_order_titles_and_formats() -> None:
    rows = [{"speedup": 3.14159, "tier": "disk", "unused": 1}, {"speedup": 12.0, "tier": "redis"}]
    columns = [Column("tier"), Column("speedup", "vs prefill", "{:.1f}x")]
    assert format_table(rows, columns).splitlines() == [
        "| tier  | vs prefill |",
        "|-------|-----------:|",
        "| disk  |       3.1x |",
        "| redis |      12.0x |",
    ]
    assert format_table(rows, ["tier"]).splitlines()[2] == "| disk  |"  # a bare key: str() of the value


def test_missing_values_leave_cells_empty_and_mixed_columns_read_as_text() -> None:
    rows = [{"a": 1, "b": "x"}, {"a": "n/a"}, {"a": True, "b": 2}]
    assert format_table(rows).splitlines() == [
        "| a    | b |",
        "|------|---|",
        "| 1    | x |",
        "| n/a  |   |",
        "| True | 2 |",
    ]


def test_no_rows_no_table() -> None:
    assert format_table([]) == ""
    assert codec.format_table([]) == ""


def test_a_format_that_does_not_fit_says_which_column() -> None:
    with pytest.raises(ValueError, match="column 'kl'"):
        format_table([{"kl": "high"}], [Column("kl", fmt="{:.4f}")])


def test_every_bench_prints_the_same_markdown_shape() -> None:
    fusion_row = dict(
        method="blend", recompute_ratio=0.15, kl=0.0312, top1=0.958, exact_match=0.33, f1=0.71, ttft_ms=412.0
    )
    tables = {
        "codec": codec.format_table(
            [
                dict(
                    codec="cachegen",
                    level=2,
                    bytes_per_token=5832.4,
                    ratio_vs_fp16=3.95,
                    ratio_vs_int8=2.08,
                    kl=0.0229,
                    top1=0.95,
                    answer_match=0.5,
                    encode_mbps=80.2,
                    decode_mbps=73.4,
                )
            ]
        ),
        "fusion": fusion.format_table([fusion_row | {"ttft_ratio": 0.22}]),
        "assemble": assemble.format_assemble_table(
            [
                dict(
                    tier="memory://",
                    k=4,
                    tokens=1600,
                    mb=5.25,
                    read_ms=1.04,
                    decode_ms=20.5,
                    assemble_ms=30.0,
                    pipelined_ms=25.0,
                    speedup=41.66,
                )
            ]
        ),
        "store": store.format_table([{"tier": "memory://", "blob_mb": 1.0}]),
    }
    for name, table in tables.items():
        head, rule, *body = table.splitlines()
        assert len(body) == 1, name
        assert rule.startswith("|-") and rule.endswith("|"), name
        assert {len(line) for line in (head, rule, *body)} == {len(head)}, name  # lines up as text
        assert len({line.count("|") for line in (head, rule, *body)}) == 1, name
    assert " 5,832 |" in tables["codec"] and "| mean KL |" in tables["codec"]
    assert "0.0312" in tables["fusion"] and "|     412 |" in tables["fusion"]
    assert tables["assemble"].endswith("|      41.7x |")
