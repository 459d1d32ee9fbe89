"""The codec benchmark, on a tiny random-weight model standing in for the real adapter."""

from __future__ import annotations

import math

from ragkv.bench.codec import ROW_KEYS, calibrate_transform, format_table, run_codec_bench
from tests.codec.tiny_adapter import TinyLlamaAdapter

PROMPTS = [
    {"system": "Be brief.", "chunks": ["alpha beta gamma " * 6, "delta epsilon " * 8], "question": "Which?"},
    {"system": "Be brief.", "chunks": ["one two three four " * 5], "question": "Count?"},
]


def test_bench_rows_have_exactly_the_documented_keys() -> None:
    rows = run_codec_bench(
        TinyLlamaAdapter(), PROMPTS, {"raw": (0,), "cachegen": (0, 3)}, answer_tokens=4, decode_repeats=1
    )
    assert [(r["codec"], r["level"]) for r in rows] == [("raw", 0), ("cachegen", 0), ("cachegen", 3)]
    for row in rows:
        assert tuple(row) == ROW_KEYS
        assert all(not isinstance(v, float) or math.isfinite(v) for v in row.values())
    raw, fine, coarse = rows
    assert raw["kl"] < 1e-4 and raw["top1"] == 1.0 and raw["answer_match"] == 1.0
    assert math.isclose(raw["ratio_vs_fp16"], 1.0, rel_tol=0.2)  # headers are the only overhead
    assert fine["kl"] <= coarse["kl"] and fine["bytes_per_token"] > coarse["bytes_per_token"]
    assert coarse["ratio_vs_int8"] > 1.5  # int8 measured in the same run as the baseline
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "cachegen" in table


def test_a_calibrated_transform_adds_rows_that_decode_like_the_plain_ones() -> None:
    adapter = TinyLlamaAdapter()
    transform = calibrate_transform(adapter, PROMPTS)
    assert transform.model_fingerprint == adapter.prefill_kv([1, 2]).model_fingerprint
    rows = run_codec_bench(adapter, PROMPTS, {"cachegen": (0,)}, answer_tokens=4, decode_repeats=1, transform=transform)
    assert [(r["codec"], r["level"]) for r in rows] == [("cachegen", 0), ("cachegen+klt", 0)]
    plain, klt = rows
    assert tuple(klt) == ROW_KEYS and math.isfinite(klt["kl"]) and klt["kl"] < 0.05
    assert math.isclose(klt["bytes_per_token"], plain["bytes_per_token"], rel_tol=0.5)
