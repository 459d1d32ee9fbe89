"""``ragkv bench serve``: throughput and latency of a live ``ragkv serve`` at several concurrency levels.

The same request mix (server-side retrieval over the indexed documents, streamed answers) runs with
chunk cache reuse and with full prefill (``ragkv.full``) in one run. TTFT is measured at the client:
request sent to first answer text received; the inter-token gap is the time between two pieces of
answer text of one stream (what a reader sees stall while another request is prefilled). The
server's own decode counters (``/health``'s ``decode``, read before and after each level) give the
milliseconds per generated token its scheduler spends outside the batched forward pass (sampling,
detokenizing, stop strings, handing events over); a server without them leaves the column empty.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from ragkv.bench.table import Column, format_table

__all__ = ["COLUMNS", "format_serve_table", "percentile", "run_serve_bench"]

COLUMNS = (
    Column("mode"),
    Column("concurrency", "conc."),
    Column("requests"),
    Column("req_s", "req/s", "{:.2f}"),
    Column("tok_s", "output tok/s", "{:.1f}"),
    Column("ttft_p50", "TTFT p50 ms", "{:,.0f}"),
    Column("ttft_p95", "TTFT p95 ms", "{:,.0f}"),
    Column("lat_p50", "latency p50 ms", "{:,.0f}"),
    Column("lat_p95", "latency p95 ms", "{:,.0f}"),
    Column("gap_p50", "gap p50 ms", "{:,.0f}"),
    Column("gap_p95", "gap p95 ms", "{:,.0f}"),
    Column("outside_ms", "outside fwd ms/tok", "{:.2f}"),
    Column("cached", "cached tok/req", "{:,.0f}"),
    Column("errors"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (0 when empty): ``q=0.95`` is the p95.

    >>> percentile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5), percentile([1.0, 2.0], 0.95), percentile([], 0.5)
    (3.0, 2.0, 0.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _one(client: Any, question: str, full: bool, max_tokens: int, top_k: int) -> dict[str, Any]:
    import json

    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ragkv": {"retrieve": True, "top_k": top_k, "full": full},
    }
    t0 = time.perf_counter()
    ttft, tokens, cached = 0.0, 0, 0
    arrivals: list[float] = []  # when each piece of answer text came
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
                ttft = ttft or arrivals[-1] - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    latency = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft": ttft or latency, "latency": latency, "tokens": tokens, "cached": cached, "gaps": gaps}


def _decode_counters(url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The server's decode counters (``/health``'s ``decode``), or None when it reports none."""
    import httpx

    try:
        decode = httpx.get(f"{url}/health", headers=headers, timeout=30).json().get("decode")
    except (httpx.HTTPError, ValueError):
        return None
    return decode if isinstance(decode, dict) and "outside_s" in decode else None


def _outside_ms_per_token(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Milliseconds per generated token spent outside the forward pass between two counter readings."""
    if before is None or after is None or after["tokens"] <= before["tokens"]:
        return None
    return 1000 * (after["outside_s"] - before["outside_s"]) / (after["tokens"] - before["tokens"])


async def _level(url: str, key: str | None, questions: Sequence[str], concurrency: int, n: int, full: bool,
                 max_tokens: int, top_k: int) -> dict[str, Any]:  # fmt: skip
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    errors = 0
    before = await asyncio.to_thread(_decode_counters, url, headers)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:

        async def run(i: int) -> None:
            nonlocal errors
            async with sem:
                try:
                    results.append(await _one(client, questions[i % len(questions)], full, max_tokens, top_k))
                except (RuntimeError, httpx.HTTPError):
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(n)))
        wall = time.perf_counter() - t0
    outside = _outside_ms_per_token(before, await asyncio.to_thread(_decode_counters, url, headers))
    gaps = [g * 1000 for r in results for g in r["gaps"]]
    ttfts = [r["ttft"] * 1000 for r in results]
    lats = [r["latency"] * 1000 for r in results]
    return {
        "mode": "full" if full else "reuse",
        "concurrency": concurrency,
        "requests": n,
        "req_s": len(results) / wall,
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "lat_p50": percentile(lats, 0.5),
        "lat_p95": percentile(lats, 0.95),
        "gap_p50": percentile(gaps, 0.5),
        "gap_p95": percentile(gaps, 0.95),
        **({"outside_ms": outside} if outside is not None else {}),
        "cached": sum(r["cached"] for r in results) / max(1, len(results)),
        "errors": errors,
    }


def run_serve_bench(
    url: str,
    concurrency: Sequence[int],
    requests: int,
    *,
    questions: Sequence[str],
    api_key: str | None = None,
    max_tokens: int = 32,
    top_k: int = 4,
) -> list[dict[str, Any]]:
    """Rows per (mode, concurrency): req/s, output tok/s, TTFT and latency p50/p95, errors.

    One warm-up request per mode runs first (it loads chunk caches into the fast tiers).
    """
    rows = []
    for full in (False, True):
        asyncio.run(_level(url, api_key, questions, 1, 1, full, 4, top_k))
        for c in concurrency:
            rows.append(asyncio.run(_level(url, api_key, questions, c, requests, full, max_tokens, top_k)))
    return rows


def format_serve_table(rows: Sequence[dict[str, Any]]) -> str:
    """The bench's table, plus the ratios the issue's targets are stated in."""
    out = [format_table(rows, COLUMNS)]
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    lines = []
    for (mode, c), r in sorted(by.items()):
        if mode == "reuse" and ("full", c) in by and by[("full", c)]["ttft_p95"]:
            lines.append(f"concurrency {c}: TTFT p95 reuse/full = {r['ttft_p95'] / by[('full', c)]['ttft_p95']:.2f}")
    for mode in ("reuse", "full"):
        if (mode, 1) in by and (mode, 4) in by and by[(mode, 1)]["tok_s"]:
            ratio = by[(mode, 4)]["tok_s"] / by[(mode, 1)]["tok_s"]
            lines.append(f"{mode}: output tok/s at concurrency 4 / concurrency 1 = {ratio:.2f}x")
    return "\n".join(out + [""] + lines)
