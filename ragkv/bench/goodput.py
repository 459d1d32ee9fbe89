"""``ragkv bench goodput``: ``ragkv serve`` against ``llama-server`` on one RAG trace, at swept arrival rates.

Both servers load the same GGUF file with the same threads and context per request and get the
same prompt text (:mod:`ragkv.bench.goodput_trace`) through the same OpenAI client (streamed chat
completions, greedy). Arrivals are Poisson at each rate, the same arrival times and requests for
both servers; the servers take turns per rate (never timed at once) and idle while the other runs.

Per server and rate: TTFT p50/p95 (request sent to first answer text, at the client), p95 gap
between two pieces of answer text of a stream, output tokens/s over the rate's span (first arrival
to last answer's end), and goodput: requests per second that completed with TTFT within the SLO.
The SLO is 2x the single-request TTFT of a full prefill, measured first on llama-server with its
prompt cache off (median of 3 prompts of the trace), unless given. A rate is *sustained* when at
least ``attain`` (0.9) of its requests met the SLO; the highest sustained rate is the highest of
the sweep below which every rate was sustained too.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragkv.bench.goodput_trace import TraceRequest
from ragkv.bench.serve import percentile
from ragkv.bench.table import Column, format_table

__all__ = [
    "COLUMNS",
    "RequestResult",
    "GoodputConfig",
    "format_goodput",
    "highest_sustained",
    "plot_goodput",
    "poisson_arrivals",
    "rate_row",
    "replay",
    "run_goodput",
    "same_answers",
]

logger = logging.getLogger(__name__)

COLUMNS = (
    Column("server"),
    Column("rate", "rate req/s", "{:g}"),
    Column("requests"),
    Column("completed"),
    Column("ttft_p50", "TTFT p50 ms", "{:,.0f}"),
    Column("ttft_p95", "TTFT p95 ms", "{:,.0f}"),
    Column("gap_p95", "gap p95 ms", "{:,.0f}"),
    Column("tok_s", "output tok/s", "{:.1f}"),
    Column("goodput", "goodput req/s", "{:.3f}"),
    Column("attained", "within SLO", "{:.0%}"),
    Column("cached", "cached tok/req", "{:,.0f}"),
)


@dataclass(slots=True)
class RequestResult:
    """One streamed request as the client saw it (times in seconds from the rate's start)."""

    index: int  # the request's position in the rate's slice of the trace
    sent: float  # when it was sent
    ttft: float = 0.0  # sent to first answer text (0 when none came)
    latency: float = 0.0  # sent to the stream's end
    tokens: int = 0  # completion tokens (the server's usage, else pieces of text)
    cached: int = 0  # the server's usage.prompt_tokens_details.cached_tokens
    gaps: list[float] = field(default_factory=list)  # between consecutive pieces of answer text
    text: str = ""
    error: str | None = None  # why it did not complete

    @property
    def completed(self) -> bool:
        """The stream ended normally with some answer text."""
        return self.error is None and self.ttft > 0


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second, the first at 0."""
    if rate <= 0:
        raise ValueError(f"an arrival rate must be > 0 requests/s; got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _stream(client: Any, model: str, prompt: str, max_tokens: int, extra: Mapping[str, Any],
                  result: RequestResult, t0: float) -> None:  # fmt: skip
    """Send one streamed greedy chat completion and fill ``result`` from its events."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=dict(extra),
    )
    last, pieces, usage_tokens = 0.0, list[str](), None
    async for event in stream:
        if event.choices and event.choices[0].delta and event.choices[0].delta.content:
            now = time.perf_counter() - t0
            if not pieces:
                result.ttft = now - result.sent
            else:
                result.gaps.append(now - last)
            last = now
            pieces.append(event.choices[0].delta.content)
        if event.usage is not None:
            usage_tokens = event.usage.completion_tokens
            details = event.usage.prompt_tokens_details
            result.cached = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
    result.text = "".join(pieces)
    result.tokens = usage_tokens if usage_tokens is not None else len(pieces)
    result.latency = time.perf_counter() - t0 - result.sent


async def replay(url: str, requests: Sequence[TraceRequest], arrivals: Sequence[float], max_tokens: int,
                 extra: Mapping[str, Any], model: str = "default") -> tuple[list[RequestResult], float]:  # fmt: skip
    """Send ``requests[i]`` at ``arrivals[i]`` seconds; the results and the span (first send to last end)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", timeout=1800, max_retries=0)
    results = [RequestResult(i, a) for i, a in enumerate(arrivals)]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
        results[i].sent = time.perf_counter() - t0
        try:
            await _stream(client, model, requests[i].prompt, max_tokens, extra, results[i], t0)
        except Exception as e:  # noqa: BLE001 - any failure of a request is its error, counted, not fatal
            results[i].error = f"{type(e).__name__}: {e}"[:300]
            logger.warning("request %d to %s failed: %s", i, url, results[i].error)

    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        await client.close()
    return results, time.perf_counter() - t0


def rate_row(server: str, rate: float, results: Sequence[RequestResult], span_s: float, slo_s: float) -> dict[str, Any]:
    """The table row of one server at one rate (times in ms; goodput in requests/s within the SLO)."""
    done = [r for r in results if r.completed]
    ttfts = [r.ttft * 1000 for r in done]
    met = sum(1 for r in done if r.ttft <= slo_s)
    span = max(span_s, 1e-9)
    return {
        "server": server,
        "rate": rate,
        "requests": len(results),
        "completed": len(done),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "gap_p95": percentile([g * 1000 for r in done for g in r.gaps], 0.95),
        "tok_s": sum(r.tokens for r in done) / span,
        "goodput": met / span,
        "attained": met / max(1, len(results)),
        "cached": sum(r.cached for r in done) / max(1, len(done)),
        "span_s": span_s,
    }


def highest_sustained(rows: Sequence[Mapping[str, Any]], server: str, attain: float = 0.9) -> float | None:
    """The highest rate of ``server`` such that it and every lower rate had ``attain`` of requests within the SLO."""
    best = None
    for row in sorted((r for r in rows if r.get("server") == server), key=lambda r: r["rate"]):
        if row["attained"] < attain:
            break
        best = row["rate"]
    return best


def same_answers(a: Sequence[RequestResult], b: Sequence[RequestResult]) -> tuple[int, int]:
    """(requests whose two completed answers are the same text after stripping, requests both completed)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x.completed and y.completed]
    return sum(1 for x, y in pairs if x.text.strip() == y.text.strip()), len(pairs)


def summarize(rows: Sequence[Mapping[str, Any]], servers: Sequence[str], attain: float) -> dict[str, Any]:
    """The highest sustained rate of each server and, at the peer's, ragkv's p95 TTFT and tokens/s ratios."""
    out: dict[str, Any] = {f"sustained_{s}": highest_sustained(rows, s, attain) for s in servers}
    peer_rate = out.get("sustained_llama-server")
    by = {(r["server"], r["rate"]): r for r in rows}
    if peer_rate is not None and ("ragkv", peer_rate) in by:
        ours, theirs = by[("ragkv", peer_rate)], by[("llama-server", peer_rate)]
        if theirs["ttft_p95"]:
            out["ttft_p95_ratio"] = ours["ttft_p95"] / theirs["ttft_p95"]
        if theirs["tok_s"]:
            out["tok_s_ratio"] = ours["tok_s"] / theirs["tok_s"]
    return out


def format_goodput(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """The table, then the SLO, the highest sustained rates, the ratios and the share of identical answers."""
    lines = [summary.get("machine", ""), format_table(rows, COLUMNS), ""]
    lines.append(f"SLO: TTFT <= {summary['slo_ms']:,.0f} ms ({summary['slo_source']})")
    for server in ("ragkv", "llama-server"):
        rate = summary.get(f"sustained_{server}")
        shown = "none of the rates" if rate is None else f"{rate:g} req/s"
        lines.append(f"highest rate sustained within the SLO ({summary['attain']:.0%} of requests): {server} {shown}")
    for key, what in (("ttft_p95_ratio", "TTFT p95"), ("tok_s_ratio", "output tok/s")):
        if key in summary:
            lines.append(f"at llama-server's highest sustained rate: {what} ragkv/llama-server = {summary[key]:.2f}")
    same, both = summary["same_answers"]
    lines.append(f"greedy answers identical (text): {same} of {both} requests both servers completed")
    return "\n".join(lines)


def plot_goodput(rows: Sequence[Mapping[str, Any]], slo_ms: float, path: Path) -> None:
    """Save a plot of p95 TTFT against arrival rate, one line per server, with the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in mine], [r["ttft_p95"] / 1000 for r in mine], marker="o", label=server)
    ax.axhline(slo_ms / 1000, color="grey", linestyle="--", label="SLO")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("TTFT p95 (s)")
    ax.set_title("TTFT p95 against arrival rate (RAG trace)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def measure_full_prefill_ttft(url: str, prompts: Sequence[TraceRequest], extra: Mapping[str, Any]) -> float:
    """Median single-request TTFT (s) of ``prompts`` one at a time, one answer token each."""
    ttfts = []
    for request in prompts:
        results, _ = asyncio.run(replay(url, [request], [0.0], 1, extra))
        if not results[0].completed:
            raise RuntimeError(f"the full-prefill request to {url} failed: {results[0].error}")
        ttfts.append(results[0].ttft)
    return sorted(ttfts)[len(ttfts) // 2]


Echo = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class GoodputConfig:
    """One run of the bench (the CLI's options)."""

    gguf: Path  # the GGUF file both servers load
    llama_server: Path  # the llama-server binary
    rates: tuple[float, ...]  # arrival rates swept, requests/s
    requests: int = 16  # requests per rate (each rate replays its own slice of the trace)
    max_tokens: int = 32  # answer tokens per request
    threads: int = 2  # threads of each server
    context: int = 4096  # context per request, both servers
    parallel: int = 4  # llama-server's slots
    cache_reuse: int = 256  # llama-server's --cache-reuse
    slo_ms: float | None = None  # None: 2x llama-server's full-prefill TTFT, measured first
    attain: float = 0.9  # share of requests within the SLO for a rate to count as sustained
    seed: int = 0  # arrival times
    start_timeout_s: float = 900.0  # model conversion on a first ragkv run takes minutes


def index_chunks(url: str, trace: Sequence[TraceRequest]) -> int:
    """POST every distinct chunk of ``trace`` to ragkv's /v1/documents, one document each; the count."""
    import httpx

    chunks = list(dict.fromkeys(c for r in trace for c in r.chunks))
    docs = [{"source": f"trace-chunk-{i}", "text": c} for i, c in enumerate(chunks)]
    r = httpx.post(f"{url}/v1/documents", json=docs, timeout=7200)
    if r.status_code != 201:
        raise RuntimeError(f"ragkv refused the trace's chunks: HTTP {r.status_code}: {r.text[:300]}")
    return len(chunks)


def _machine(ragkv_url: str) -> str:
    """The bench's machine note: the model, ragkv's dtype and why, its decode weights, the CPU."""
    import httpx

    from ragkv.bench.table import machine_note

    health = httpx.get(f"{ragkv_url}/health", timeout=30).json()
    note = machine_note(health.get("model", "?"), health.get("dtype", "?"), health.get("dtype_reason", "?"))
    return f"{note}; ragkv decode weights: {health.get('decode_weights', '?')}"


def _slo(cfg: GoodputConfig, peer_url: str, trace: Sequence[TraceRequest], echo: Echo) -> tuple[float, str]:
    if cfg.slo_ms is not None:
        return cfg.slo_ms / 1000, "given with --slo-ms"
    echo("measuring the SLO: llama-server, prompt cache off, one request at a time ...")
    full = measure_full_prefill_ttft(peer_url, trace[:3], {"cache_prompt": False})
    return 2 * full, f"2x llama-server's single-request full-prefill TTFT of {full * 1000:,.0f} ms, cache off"


def run_goodput(cfg: GoodputConfig, trace: Sequence[TraceRequest], workdir: Path,
                echo: Echo = logger.info) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Start both servers, index the chunks into ragkv, measure the SLO, replay every rate on each server.

    Returns:
        (rows per server and rate, summary: SLO, highest sustained rates, ratios, identical answers).

    Raises:
        ServerStartError: a server exited or never became healthy (both are stopped; none is timed).
    """
    from contextlib import ExitStack

    from ragkv.bench.goodput_servers import ServerProcess, llama_server_spec, ragkv_serve_spec, wait_all_ready

    if len(trace) < cfg.requests * len(cfg.rates):
        raise ValueError(f"the trace has {len(trace)} requests; {len(cfg.rates)} rates x {cfg.requests} need more")
    specs = (
        ragkv_serve_spec(str(cfg.gguf), cfg.threads, workdir / "ragkv-data", cfg.max_tokens),
        llama_server_spec(cfg.llama_server, cfg.gguf, cfg.threads, cfg.context, cfg.parallel, cfg.cache_reuse),
    )
    with ExitStack() as stack:
        servers = [stack.enter_context(ServerProcess(s, workdir / f"{s.name}.log")) for s in specs]
        echo("starting ragkv serve and llama-server ...")
        wait_all_ready(servers, cfg.start_timeout_s)
        machine = _machine(specs[0].url)
        echo(f"indexing the trace's chunks into ragkv ({index_chunks(specs[0].url, trace)} chunks) ...")
        # The SLO and warm-up prompts: the trace's requests past the timed ones (the CLI adds 3), if any.
        spare = list(trace[cfg.requests * len(cfg.rates) :]) or list(trace[:3])
        slo_s, slo_source = _slo(cfg, specs[1].url, spare[:3], echo)
        for spec in specs:  # warm-up: first-request costs (allocations, thread pools) stay out of the timings
            asyncio.run(replay(spec.url, spare[-1:], [0.0], 2, spec.extra_body))
        rows, same, both = [], 0, 0
        for k, rate in enumerate(cfg.rates):
            part = trace[k * cfg.requests : (k + 1) * cfg.requests]
            arrivals = poisson_arrivals(cfg.requests, rate, cfg.seed + k)
            answers: dict[str, list[RequestResult]] = {}
            for spec in specs if k % 2 == 0 else specs[::-1]:  # alternate who goes first
                results, span = asyncio.run(replay(spec.url, part, arrivals, cfg.max_tokens, spec.extra_body))
                answers[spec.name] = results
                rows.append(rate_row(spec.name, rate, results, span, slo_s))
                echo(f"  {spec.name} at {rate:g} req/s: TTFT p95 {rows[-1]['ttft_p95']:,.0f} ms, "
                     f"{rows[-1]['completed']}/{cfg.requests} completed")  # fmt: skip
            s, b = same_answers(answers["ragkv"], answers["llama-server"])
            same, both = same + s, both + b
    rows.sort(key=lambda r: (r["server"] != "ragkv", r["rate"]))
    summary = summarize(rows, [s.name for s in specs], cfg.attain)
    summary.update(slo_ms=slo_s * 1000, slo_source=slo_source, attain=cfg.attain, same_answers=(same, both))
    flags = specs[1].command[specs[1].command.index("-t") :]
    summary["llama_server_settings"] = " ".join(flags) + " + cache_prompt: true per request"
    summary["machine"] = machine
    return rows, summary
