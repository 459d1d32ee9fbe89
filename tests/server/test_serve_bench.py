"""``ragkv bench serve``'s runner against a real server: rows for both modes and every level, no errors."""

from __future__ import annotations

import json
import subprocess
import sys

from ragkv.bench.serve import format_serve_table, run_serve_bench
from ragkv.retriever.corpus import stdlib_corpus
from tests.server.conftest import RAY_REPLICAS, start_server, stop_server


def test_serve_bench_rows_for_reuse_and_full(server):
    questions = ["Where do apples grow?", "What do boats carry?"]
    rows = run_serve_bench(server.url, [1, 2], 2, questions=questions, max_tokens=4, top_k=1)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("reuse", 1), ("reuse", 2), ("full", 1), ("full", 2)]
    assert all(r["errors"] == 0 and r["req_s"] > 0 and r["ttft_p95"] >= r["ttft_p50"] > 0 for r in rows)
    assert all(r["cached"] > 0 for r in rows if r["mode"] == "reuse")
    assert all(r["cached"] == 0 for r in rows if r["mode"] == "full")
    # streams of 4 tokens: gaps between their text pieces; the server's counters: time outside the forward
    # (read from /health, which with --ray is one replica's: that one may have decoded nothing)
    assert all(r["gap_p95"] >= r["gap_p50"] >= 0 and (r.get("outside_ms", 0) > 0 or RAY_REPLICAS) for r in rows)
    table = format_serve_table(rows)
    assert "TTFT p95 reuse/full" in table and "| reuse" in table


def test_the_cli_indexes_the_demo_documents_on_a_fresh_server(tiny_model_dir, tmp_path):
    """``ragkv bench serve`` against an empty server: it indexes the demo corpus (showing progress), then runs."""
    served = start_server(tiny_model_dir, tmp_path / "fresh")
    try:
        cmd = [sys.executable, "-m", "ragkv.cli", "bench", "serve", "--url", served.url, "--concurrency", "1",
               "--requests", "1", "--max-tokens", "2", "--json", str(tmp_path / "rows.json")]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "indexing the stdlib demo documents" in out.stderr and "embedding 10/10" in out.stderr
        rows = json.loads((tmp_path / "rows.json").read_text())
        assert [(r["mode"], r["errors"]) for r in rows] == [("reuse", 0), ("full", 0)]
        with served.client() as c:
            assert len(c.get("/v1/documents").json()["data"]) == len(stdlib_corpus())
    finally:
        stop_server(served)
