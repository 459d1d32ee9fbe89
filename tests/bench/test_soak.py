"""The soak bench's summary: 5xx counted, RSS growth measured after the warm-up only."""

from __future__ import annotations

import os
from collections import Counter

from ragkv.bench.soak import format_soak, rss_bytes, rss_growth


def test_growth_starts_after_the_warm_up():
    samples = [(0.0, 100), (30.0, 400), (60.0, 400), (120.0, 440)]
    assert rss_growth(samples, warmup_s=24.0) == 0.1  # 400 -> 440; the warm-up's 100 -> 400 is left out


def test_the_table_counts_5xx_and_reads_its_numbers():
    rss = [(0.0, 2**30), (60.0, 2**30), (300.0, 2**30 + 2**26)]
    result = {"status": Counter({200: 10, 503: 2, 429: 1}), "ttft_ms": [10.0, 20.0, 30.0], "tokens": 120,
              "rss": rss, "errors": Counter(), "wall_s": 60.0}  # fmt: skip
    table, rows = format_soak(result, minutes=5)
    values = {r["metric"]: r["value"] for r in rows}
    assert values["requests"] == 13 and values["5xx"] == 2 and values["output tok/s"] == "2.0"
    assert values["TTFT p50 ms (streamed)"] == "20" and values["RSS growth after warm-up"] == "+6.2%"
    assert values["RSS start / after warm-up / end MiB"] == "1,024 / 1,024 / 1,088"
    assert "| metric" in table


def test_rss_of_this_process():
    assert (rss_bytes(os.getpid()) or 0) > 0
    assert rss_bytes(2**22 + 12345) is None
