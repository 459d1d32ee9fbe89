"""``ragkv bench serve``'s runner against a real server: rows for both modes and every level, no errors."""

from __future__ import annotations

from ragkv.bench.serve import format_serve_table, run_serve_bench


def test_serve_bench_rows_for_reuse_and_full(server):
    questions = ["Where do apples grow?", "What do boats carry?"]
    rows = run_serve_bench(server.url, [1, 2], 2, questions=questions, max_tokens=4, top_k=1)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("reuse", 1), ("reuse", 2), ("full", 1), ("full", 2)]
    assert all(r["errors"] == 0 and r["req_s"] > 0 and r["ttft_p95"] >= r["ttft_p50"] > 0 for r in rows)
    assert all(r["cached"] > 0 for r in rows if r["mode"] == "reuse")
    assert all(r["cached"] == 0 for r in rows if r["mode"] == "full")
    table = format_serve_table(rows)
    assert "TTFT p95 reuse/full" in table and "| reuse" in table
