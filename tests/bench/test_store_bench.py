"""ragkv.bench.store: rows for every tier and size, a printable table (no timing asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.bench.store import format_table, main, run_store_bench


def test_bench_rows_cover_baseline_tiers_and_sizes(tmp_path: Path) -> None:
    rows = run_store_bench(["memory://", f"disk://{tmp_path / 'kv'}"], blob_sizes=(1000, 5000), n=3)
    assert [(r["tier"], r["blob_mb"]) for r in rows] == [
        ("baseline: raw files", 0.001),
        ("baseline: raw files", 0.005),
        ("memory://", 0.001),
        ("memory://", 0.005),
        (f"disk://{tmp_path / 'kv'}", 0.001),
        (f"disk://{tmp_path / 'kv'}", 0.005),
    ]
    assert all(r["stored"] == 3 and r["get_mb_s"] > 0 for r in rows)
    assert rows[0]["get_p50_vs_baseline"] == 1.0
    assert list((tmp_path / "kv").rglob("*.val")) == []  # the bench cleans up after itself


def test_format_table() -> None:
    table = format_table([{"tier": "memory://", "get_mb_s": 1.5}, {"tier": "x", "get_mb_s": 10.0}])
    assert table.splitlines() == [
        "| tier      | get_mb_s |",
        "|-----------|---------:|",
        "| memory:// |      1.5 |",
        "| x         |     10.0 |",
    ]
    assert format_table([]) == ""


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    main(["memory://", "--n", "2", "--sizes", "0.001"])
    assert "memory://" in capsys.readouterr().out


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_store_bench([], n=1)
