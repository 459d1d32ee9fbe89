"""``ragkv bench serve|vllm|soak|goodput``: the benchmarks that start servers (registered on ``bench_app``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from ragkv.cli.bench import JsonOut, _write_rows, bench_app
from ragkv.cli.options import Model, engine_config

__all__: list[str] = []


@bench_app.command("serve")
def bench_serve(
    url: Annotated[str, typer.Option("--url", help="A running ragkv serve.")] = "http://127.0.0.1:8000",
    concurrency: Annotated[str, typer.Option("--concurrency", help="Levels, comma-separated.")] = "1,2,4,8",
    requests: Annotated[int, typer.Option("--requests", help="Requests per level and mode.", min=1)] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer tokens per request.", min=1)] = 32,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Bearer key (servers with --api-keys).")] = None,
    out: JsonOut = None,
) -> None:
    """Requests/s, tokens/s, TTFT and latency of a live server, with chunk cache reuse and with --full.

    Indexes the stdlib demo documents through POST /v1/documents first when the server has none.
    """

    from ragkv.bench.serve import format_serve_table, run_serve_bench
    from ragkv.retriever.corpus import DEMO_QUESTIONS

    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    _ensure_demo_documents(url, api_key)
    rows = run_serve_bench(url, levels, requests, questions=DEMO_QUESTIONS, api_key=api_key, max_tokens=max_tokens)
    typer.echo(format_serve_table(rows))
    _write_rows(rows, out)


@bench_app.command("vllm")
def bench_vllm(
    questions: Annotated[int, typer.Option("--questions", help="RAG prompts (one per QA question).", min=1)] = 12,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens of the end-to-end request.", min=1)] = 32,
    docs: Annotated[int, typer.Option("--docs", help="QA documents indexed.", min=1)] = 10,
    ratio: Annotated[
        float | None, typer.Option("--ratio", help="Fusion ratio (share of chunk tokens recomputed) [ragkv's].")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "--model-folder", help="An alias, a .gguf file or a model folder [ragkv's default model]."
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", help="Also send this many requests at once (requests/s).", min=1)
    ] = 1,
    load_async: Annotated[
        bool,
        typer.Option("--load-async/--load-sync", help="The connector loads while vLLM steps other requests."),
    ] = False,
    vllm_dtype: Annotated[
        str | None, typer.Option("--vllm-dtype", help="vLLM's dtype [the one ragkv runs in here].")
    ] = None,
    out: JsonOut = None,
) -> None:
    """TTFT, answers and requests/s of vLLM alone vs vLLM with ragkv's KV connector, same prompts and engine.

    Runs in vLLM's own virtual environment (bash tools/vllm_env.sh --no-test builds it).
    """
    from ragkv.bench.table import Column, format_table, machine_note
    from ragkv.bench.vllm import (
        ANSWER_COLUMNS,
        VllmBenchConfig,
        VllmMissingError,
        format_vllm_summary,
        require_vllm,
        run_vllm_bench,
    )

    try:
        require_vllm()
        cfg = VllmBenchConfig(questions, max_tokens, docs, ratio, model, concurrency, load_async, vllm_dtype)
    except VllmMissingError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    rows, summary = run_vllm_bench(cfg, echo=lambda line: typer.echo(line, err=True))
    # the CPU's flags go beside every figure (the JSON too): vLLM's CPU kernels differ by far with AVX-512/bf16
    summary["machine"] = machine_note(
        model or "smollm2-135m", summary["ragkv_dtype"], f"vLLM in {summary['vllm_dtype']}"
    )
    typer.echo(summary["machine"])
    typer.echo(format_table(rows, [Column(k) for k in rows[0] if k not in ANSWER_COLUMNS]))
    for line in format_vllm_summary(summary):
        typer.echo(line)
    _write_rows([*rows, {"summary": summary}], out)


@bench_app.command("soak")
def bench_soak(
    url: Annotated[str, typer.Option("--url", help="A running ragkv serve.")] = "http://127.0.0.1:8000",
    minutes: Annotated[float, typer.Option("--minutes", help="How long to run.", min=0.1)] = 30.0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Requests in flight.", min=1)] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer tokens per request.", min=1)] = 32,
    api_key: Annotated[
        list[str] | None, typer.Option("--api-key", help="A tenant's bearer key (repeat: one per tenant).")
    ] = None,
    pid: Annotated[int | None, typer.Option("--pid", help="The server's process id, to sample its RSS.")] = None,
    out: JsonOut = None,
) -> None:
    """Steady mixed load (streamed, blocking, abandoned) over the tenants' keys: 5xx, TTFT, tokens/s, RSS growth.

    Indexes the stdlib demo documents for each tenant that has none first.
    """

    from ragkv.bench.soak import format_soak, run_soak
    from ragkv.retriever.corpus import DEMO_QUESTIONS

    keys: list[str | None] = list(api_key) if api_key else [None]
    for key in keys:
        _ensure_demo_documents(url, key)
    result = run_soak(url, keys, DEMO_QUESTIONS, minutes=minutes, concurrency=concurrency, max_tokens=max_tokens,
                      pid=pid)  # fmt: skip
    table, rows = format_soak(result, minutes)
    typer.echo(table)
    _write_rows(rows, out)


def _ensure_demo_documents(url: str, api_key: str | None) -> None:
    """Index the stdlib demo documents on the server (for ``api_key``'s tenant) unless it has some."""
    import httpx

    from ragkv.retriever.corpus import stdlib_corpus

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=3600) as client:
        if not client.get("/v1/documents").raise_for_status().json()["data"]:
            typer.echo("indexing the stdlib demo documents on the server ...", err=True)
            docs = [{"source": d.source, "text": d.text, "title": d.title} for d in stdlib_corpus()]
            _index_on_server(client, docs)


def _index_on_server(client: Any, docs: list[dict[str, str]]) -> None:
    """POST ``docs`` to a server's /v1/documents, showing its streamed progress on stderr."""
    report: dict[str, Any] = {}
    with client.stream("POST", "/v1/documents?stream=true", json=docs) as r:
        if r.status_code != 200:
            r.read()
            typer.echo(f"error: the server refused the documents: HTTP {r.status_code}: {r.text[:300]}", err=True)
            raise typer.Exit(2)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("object") == "document.progress":
                typer.echo(f"\r  {event['phase']} {event['done']}/{event['total']}    ", err=True, nl=False)
            else:
                report = event
    typer.echo("", err=True)
    if "error" in report or report.get("status") != 201:
        typer.echo(f"error: indexing the demo documents on the server failed: {report}", err=True)
        raise typer.Exit(2)


@bench_app.command("goodput")
def bench_goodput(
    model: Model = None,
    rates: Annotated[str, typer.Option("--rates", help="Poisson arrival rates swept, req/s, comma-separated.")] = (
        "0.05,0.1,0.2"
    ),
    requests: Annotated[int, typer.Option("--requests", help="Requests per rate.", min=1)] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer tokens per request (greedy).", min=1)] = 32,
    threads: Annotated[int | None, typer.Option("--threads", help="Threads of each server [the CPU count].")] = None,
    ctx: Annotated[int, typer.Option("--ctx", help="Context per request, both servers.", min=256)] = 4096,
    parallel: Annotated[int, typer.Option("--parallel", help="llama-server's slots (-np).", min=1)] = 4,
    cache_reuse: Annotated[int, typer.Option("--cache-reuse", help="llama-server's --cache-reuse N.", min=0)] = 256,
    zipf: Annotated[float, typer.Option("--zipf", help="Zipf skew of chunk popularity (0: uniform).", min=0)] = 1.0,
    chunk_tokens: Annotated[int, typer.Option("--chunk-tokens", help="Largest chunk of the corpus.", min=64)] = 384,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the trace and the arrivals.")] = 0,
    trace: Annotated[Path | None, typer.Option("--trace", help="A JSONL trace {chunks, question} to replay.")] = None,
    save_trace: Annotated[Path | None, typer.Option("--save-trace", help="Write the trace used here (JSONL).")] = None,
    slo_ms: Annotated[float | None, typer.Option("--slo-ms", help="TTFT SLO [2x llama-server's full prefill].")] = None,
    llama_server: Annotated[
        str | None, typer.Option("--llama-server", help="The llama-server binary [RAGKV_LLAMA_SERVER, PATH].")
    ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Save a p95 TTFT vs rate plot here.")] = None,
    out: JsonOut = None,
) -> None:
    """ragkv serve against llama-server on one RAG trace at swept Poisson rates: TTFT, goodput, tokens/s.

    Both load the same GGUF with the same threads; see docs/goodput.md.
    """
    import tempfile

    from ragkv.bench import goodput as gp
    from ragkv.bench import goodput_trace as gt
    from ragkv.bench.goodput_servers import LlamaServerMissingError, ServerStartError, find_llama_server
    from ragkv.bench.peer import gguf_path

    try:
        binary = find_llama_server(llama_server)
    except LlamaServerMissingError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        gguf = gguf_path(model or engine_config().model)
        swept = tuple(float(r) for r in rates.split(",") if r.strip())
        if not swept or min(swept) <= 0:
            raise ValueError(f"--rates needs positive rates; got {rates!r}")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    text_tokens, prompt_tokens = gt.gguf_token_counters(gguf)
    try:
        if trace is not None:
            requests_ = gt.load_trace(trace)
        else:
            corpus = gt.trace_corpus(text_tokens, chunk_tokens)  # 3 spare requests: the SLO and the warm-up
            requests_ = gt.build_trace(corpus, requests * len(swept) + 3, skew=zipf, seed=seed)
        if len(requests_) < requests * len(swept):
            raise ValueError(f"{trace}: {len(requests_)} requests; {len(swept)} rates x {requests} requests need more")
        longest = gt.check_context(requests_, prompt_tokens, ctx, max_tokens, str(trace or "generated trace"))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--trace" if trace else "--ctx") from e
    if save_trace is not None:
        gt.save_trace(requests_, save_trace)
    typer.echo(f"trace: {len(requests_)} requests, prompts up to {longest} tokens; llama-server: {binary}", err=True)
    cfg = gp.GoodputConfig(gguf, binary, swept, requests, max_tokens, threads or os.cpu_count() or 1, ctx, parallel,
                           cache_reuse, slo_ms, seed=seed)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ragkv-goodput-") as tmp:
        try:
            rows, summary = gp.run_goodput(cfg, requests_, Path(tmp), echo=lambda line: typer.echo(line, err=True))
        except ServerStartError as e:
            typer.echo(f"error: {e}\n(no server was timed)", err=True)
            raise typer.Exit(2) from e
    typer.echo(gp.format_goodput(rows, summary))
    typer.echo(f"llama-server settings: {summary['llama_server_settings']}")
    _write_rows([*rows, {"summary": summary}], out)
    if plot:
        gp.plot_goodput(rows, summary["slo_ms"], plot)
