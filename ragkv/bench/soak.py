"""``ragkv bench soak``: a live ``ragkv serve`` under steady mixed load for minutes, watching for 5xx and growth.

Workers (``concurrency`` of them) send requests back to back, each to the next tenant's key in
turn: a streamed answer (half of them), a blocking one (three in ten) or a streamed one abandoned
after its first text (one in five: the client closes the connection, as a browser tab that
closes would). The server's resident memory (``VmRSS`` of ``--pid``, Linux) is sampled every few
seconds; its growth is measured from the end of the warm-up (the first fifth of the run) to the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragkv.bench.table import Column, format_table

__all__ = ["SoakResult", "format_soak", "rss_growth", "run_soak"]

COLUMNS = (Column("metric"), Column("value"))
SoakResult = dict[str, Any]


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` in bytes (None where /proc is missing or the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_growth(samples: Sequence[tuple[float, int]], warmup_s: float) -> float | None:
    """Relative RSS growth from the first sample after ``warmup_s`` to the last one.

    >>> rss_growth([(0.0, 100), (10.0, 200), (20.0, 210)], warmup_s=5.0)
    0.05
    >>> rss_growth([(0.0, 100)], warmup_s=5.0) is None
    True
    """
    after = [rss for t, rss in samples if t >= warmup_s]
    return None if len(after) < 2 else round(after[-1] / after[0] - 1, 6)


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def _request(client: Any, kind: str, body: dict[str, Any], out: SoakResult) -> None:
    """One request of ``kind`` (stream, blocking, abandon); records status, TTFT and tokens into ``out``."""
    t0 = time.perf_counter()
    if kind == "blocking":
        r = await client.post("/v1/chat/completions", json=body)
        out["status"][r.status_code] += 1
        if r.status_code == 200:
            out["tokens"] += r.json()["usage"]["completion_tokens"]
        return
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=stream_body) as r:
        out["status"][r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                if kind == "abandon":
                    return  # leaving the block closes the connection mid-answer
                if t0:
                    out["ttft_ms"].append((time.perf_counter() - t0) * 1000)
                    t0 = 0.0
            if event.get("usage"):
                out["tokens"] += event["usage"]["completion_tokens"]


async def _soak(url: str, keys: Sequence[str | None], questions: Sequence[str], minutes: float, concurrency: int,
                max_tokens: int, pid: int | None, seed: int) -> SoakResult:  # fmt: skip
    import httpx

    rng = random.Random(seed)
    out: SoakResult = {"status": Counter(), "ttft_ms": [], "tokens": 0, "rss": [], "errors": Counter()}
    clients = [
        httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"} if k else {}, timeout=600)
        for k in keys
    ]
    t_start = time.perf_counter()
    end = t_start + minutes * 60
    turn = 0

    async def worker() -> None:
        nonlocal turn
        while time.perf_counter() < end:
            turn += 1
            kind = rng.choices(("stream", "blocking", "abandon"), weights=(5, 3, 2))[0]
            body = {"messages": [{"role": "user", "content": rng.choice(questions)}], "max_tokens": max_tokens,
                    "ragkv": {"retrieve": True}}  # fmt: skip
            try:
                await _request(clients[turn % len(clients)], kind, body, out)
            except httpx.HTTPError as e:
                out["errors"][type(e).__name__] += 1

    async def sampler() -> None:
        while pid is not None and time.perf_counter() < end:
            rss = rss_bytes(pid)
            if rss is not None:
                out["rss"].append((time.perf_counter() - t_start, rss))
            await asyncio.sleep(5)

    try:
        await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    out["wall_s"] = time.perf_counter() - t_start
    return out


def run_soak(
    url: str,
    keys: Sequence[str | None],
    questions: Sequence[str],
    *,
    minutes: float,
    concurrency: int = 8,
    max_tokens: int = 32,
    pid: int | None = None,
    seed: int = 0,
) -> SoakResult:
    """Run the soak; the raw result (status counts, TTFTs, tokens, RSS samples) for :func:`format_soak`."""
    return asyncio.run(_soak(url, keys, questions, minutes, concurrency, max_tokens, pid, seed))


def _rss_row(samples: Sequence[tuple[float, int]], warmup_s: float) -> str:
    if not samples:
        return "n/a"
    warm = next((rss for t, rss in samples if t >= warmup_s), samples[-1][1])
    return " / ".join(f"{v / 2**20:,.0f}" for v in (samples[0][1], warm, samples[-1][1]))


def format_soak(result: SoakResult, minutes: float) -> tuple[str, list[dict[str, Any]]]:
    """The soak's table, and its rows (for ``--out``)."""
    status: Counter[int] = result["status"]
    growth = rss_growth(result["rss"], warmup_s=minutes * 60 / 5)
    rss = result["rss"]
    rows: list[dict[str, Any]] = [
        {"metric": "requests", "value": sum(status.values())},
        {"metric": "by status", "value": ", ".join(f"{s}: {n}" for s, n in sorted(status.items()))},
        {"metric": "5xx", "value": sum(n for s, n in status.items() if s >= 500)},
        {"metric": "client errors (transport)", "value": sum(result["errors"].values())},
        {"metric": "TTFT p50 ms (streamed)", "value": f"{_pct(result['ttft_ms'], 0.5):,.0f}"},
        {"metric": "TTFT p95 ms (streamed)", "value": f"{_pct(result['ttft_ms'], 0.95):,.0f}"},
        {"metric": "output tok/s", "value": f"{result['tokens'] / max(result['wall_s'], 1e-9):.1f}"},
        {"metric": "RSS start / after warm-up / end MiB", "value": _rss_row(rss, minutes * 60 / 5)},
        {"metric": "RSS growth after warm-up", "value": "n/a" if growth is None else f"{growth:+.1%}"},
    ]
    return format_table(rows, COLUMNS), rows
