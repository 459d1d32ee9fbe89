"""``ragkv bench load`` on a tiny saved model: one row per fresh process, first then later loads."""

from __future__ import annotations

from ragkv.bench.load import run_load_bench
from tests.conftest import make_model, make_tokenizer


def test_load_bench_times_fresh_processes(tmp_path):
    tok = make_tokenizer()
    make_model("qwen2", len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rows = run_load_bench(str(tmp_path), "float32", repeats=1)
    assert [r["load"] for r in rows] == ["first (converts)", "later"]
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 0 and r["dtype"] == "float32" for r in rows)
    assert rows[0]["dtype_reason"] == "asked for"
