"""``ragkv bench ...``: the benchmarks a user runs (each prints a table; ``--json`` writes its rows).

Experiments that are not commands live in ``experiments/`` at the repository root.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ragkv.cli.options import Device, Dtype, Model, SloMs, engine_config

__all__ = ["bench_app"]

bench_app = typer.Typer(
    help="Benchmarks (print a table; --json writes rows).", no_args_is_help=True, rich_markup_mode=None
)


def _load_model(model: str | None, dtype: str | None = None, device: str | None = None) -> Any:
    """The model the options name, placed as EngineConfig would place it (its defaults, RAGKV_* variables)."""
    from ragkv.bench.table import machine_note
    from ragkv.model import load_model
    from ragkv.model.placement import dtype_name

    cfg = engine_config(model=model, dtype=dtype, device=device)
    adapter = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, offline=cfg.offline)
    typer.echo(machine_note(adapter.name, dtype_name(adapter.dtype), adapter.dtype_reason))
    return adapter


def _bench_prompts(spec: str, adapter: Any, limit: int, max_tokens: int) -> list[dict[str, Any]]:
    """``--prompts``: a prompt set's name (``builtin``, ``packages``) or a JSONL file's path."""
    from ragkv.bench.prompt_sets import PROMPT_SETS, prompt_set

    if spec in PROMPT_SETS:
        try:
            return prompt_set(spec, adapter, n=limit, max_tokens=max_tokens)
        except ValueError as e:  # the set's sources are missing on this machine
            raise typer.BadParameter(str(e), param_hint="--prompts") from e
    path = Path(spec)
    if not path.is_file():
        raise typer.BadParameter(
            f"{spec!r} is neither a prompt set ({', '.join(sorted(PROMPT_SETS))}) nor a JSONL file",
            param_hint="--prompts",
        )
    return _load_prompts(path)[:limit]


def _load_prompts(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(row.get("chunks"), list) or not isinstance(row.get("question"), str):
            raise typer.BadParameter(f"{path}:{n}: needs 'chunks' (list of str) and 'question' (str)")
        rows.append({"system": row.get("system") or None, "chunks": row["chunks"], "question": row["question"]})
    return rows


def _write_rows(rows: list[dict[str, Any]], out: Path | None) -> None:
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
        typer.echo(f"wrote {len(rows)} rows to {out}")


Prompts = Annotated[
    str,
    typer.Option(
        "--prompts",
        help="Prompt set: builtin (stdlib docs), packages (PyPI package descriptions), "
        "or a JSONL file with {system, chunks, question} per line.",
    ),
]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write result rows to this file.")]


@bench_app.command("fusion")
def bench_fusion(
    prompts: Prompts = "builtin",
    model: Model = None,
    out: JsonOut = None,
    limit: Annotated[int, typer.Option("--limit", help="Use at most this many prompts.")] = 12,
    methods: Annotated[str | None, typer.Option("--methods", help="method:ratio,... to run")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Save a KL vs TTFT plot here.")] = None,
    dtype: Dtype = None,
    device: Device = None,
) -> None:
    """Fidelity and TTFT of fusion methods against full prefill (in the model's dtype)."""
    from ragkv.bench.fusion import DEFAULT_GRID, format_table, parse_grid, plot_rows, run_fusion_bench

    try:
        grid = parse_grid(methods) if methods else DEFAULT_GRID
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--methods") from e
    adapter = _load_model(model, dtype, device)
    rows = run_fusion_bench(adapter, _bench_prompts(prompts, adapter, limit, max_tokens=2800), grid, limit=limit)
    typer.echo(format_table(rows))
    _write_rows(rows, out)
    if plot:
        plot_rows(rows, plot)


@bench_app.command("qa")
def bench_qa(
    model: Model = None,
    out: JsonOut = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use at most this many questions [all].")] = None,
    only: Annotated[str | None, typer.Option("--only", help="Question ids to run, comma-separated [all].")] = None,
    methods: Annotated[
        str, typer.Option("--methods", help="method[:ratio],...; 'default' = the engine's default fusion.")
    ] = "full,naive,blend,query_focus,default",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Answer tokens (greedy).")] = 24,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the distractor documents and their order.")] = 0,
    decode_weights: Annotated[
        str, typer.Option("--decode-weights", help="Weights the answers are decoded with: model, int8 or int4.")
    ] = "model",
    dtype: Dtype = None,
    device: Device = None,
) -> None:
    """Answers scored against gold on an invented multi-document QA set, per fusion method."""
    from ragkv.bench.qa import format_qa_table, parse_methods, run_qa_bench
    from ragkv.model.attention import DECODE_WEIGHTS

    try:
        grid = parse_methods(methods)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--methods") from e
    partial = None if out is None else out.with_name(out.name + ".partial.jsonl")  # a long run's answers so far
    if partial is not None:
        partial.write_text("")

    def progress(record: dict[str, Any]) -> None:
        if partial is not None:
            with partial.open("a") as f:
                f.write(json.dumps(record) + "\n")

    if decode_weights not in DECODE_WEIGHTS:
        raise typer.BadParameter(f"one of {', '.join(DECODE_WEIGHTS)}", param_hint="--decode-weights")
    adapter = _load_model(model, dtype, device)
    ids = [i.strip() for i in (only or "").split(",") if i.strip()]
    result = run_qa_bench(
        adapter,
        methods=grid,
        limit=limit,
        only=ids,
        max_tokens=max_tokens,
        seed=seed,
        on_question=progress,
        decode_weights=decode_weights,
    )
    typer.echo(format_qa_table(result))
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
        typer.echo(f"wrote {len(result['rows'])} rows and {len(result['questions'])} answers to {out}")


@bench_app.command("load")
def bench_load(
    model: Model = None,
    dtype: Dtype = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Later loads to time after the first.")] = 2,
) -> None:
    """Time a fresh process's model load: the first converts (empty cache), later ones read the entry."""
    from ragkv.bench.load import run_load_bench
    from ragkv.bench.table import Column, format_table

    cfg = engine_config(model=model, dtype=dtype)
    rows = run_load_bench(cfg.model, cfg.dtype, repeats=repeats)
    columns = (
        "model",
        "load",
        Column("seconds", "seconds", "{:.1f}"),
        Column("peak_rss_mb", "peak RSS MB", "{:,.0f}"),
        "dtype",
        "dtype_reason",
    )
    typer.echo(format_table(rows, columns))


@bench_app.command("gpu")
def bench_gpu(
    contexts: Annotated[str | None, typer.Option(help="Prompt lengths in tokens (default 4096,16384,32768).")] = None,
    chunk: Annotated[int | None, typer.Option(help="Tokens per chunk (default 512; 64 with --tiny).")] = None,
    codec: Annotated[str, typer.Option(help="codec:level the chunks are stored with (the host rows).")] = "raw:0",
    method: Annotated[str, typer.Option(help="Fusion method.")] = "query_focus",
    ratio: Annotated[float, typer.Option(help="Share of chunk tokens recomputed.")] = 0.15,
    repeats: Annotated[int, typer.Option(help="Timed runs per measurement (the best is kept).")] = 3,
    tiny: Annotated[bool, typer.Option("--tiny", help="A tiny config (on the CPU when there is no GPU).")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows here.")] = None,
) -> None:
    """Reuse against full prefill on a GPU at Llama-3.1-8B's shape (random weights, bf16): full
    prefill, fused from host memory and from the device tier, and where the time goes."""
    from ragkv.bench.gpu import main as gpu_main

    argv = ["--codec", codec, "--method", method, "--ratio", str(ratio), "--repeats", str(repeats)]
    argv += ["--contexts", contexts] if contexts else []
    argv += ["--chunk", str(chunk)] if chunk else []
    argv += ["--tiny"] if tiny else []
    argv += ["--json", str(json_out)] if json_out else []
    gpu_main(argv)


@bench_app.command("peer")
def bench_peer(
    model: Model = None,
    prompts: Prompts = "packages",
    limit: Annotated[int, typer.Option("--limit", help="RAG prompts (about 2K tokens each).")] = 4,
    repeats: Annotated[int, typer.Option("--repeats", help="Interleaved rounds over the prompts.")] = 3,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Tokens timed per answer.")] = 32,
    threads: Annotated[int | None, typer.Option("--threads", help="Threads for both sides [torch's].")] = None,
    busy: Annotated[
        int, typer.Option("--busy", help="Other processes keeping a core busy each while timing (a shared machine).")
    ] = 0,
    dtype: Dtype = None,
    out: JsonOut = None,
) -> None:
    """ragkv (fused, full, int8/int4 decode) against llama.cpp on the same GGUF and prompt token ids.

    llama.cpp keeps its thread count; ragkv's follows RAGKV_THREADS (auto: the cores other processes
    leave free).
    """
    import tempfile

    import torch

    from ragkv.bench.peer import (
        ANATOMY_COLUMNS,
        PeerMissingError,
        bench_engine,
        busy_processes,
        decode_anatomy,
        format_peer_table,
        gguf_path,
        load_llama,
        machine_load,
        peer_prompts,
        run_peer_bench,
    )
    from ragkv.bench.table import format_table

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        gguf = gguf_path(model or engine_config().model)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from e
    adapter = _load_model(str(gguf), dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="ragkv-peer-") as tmp:
        engine = bench_engine(adapter, "model", Path(tmp))
        peers = peer_prompts(engine, _bench_prompts(prompts, adapter, limit, max_tokens=2800))
        llm = None
        try:
            llm = load_llama(gguf, torch.get_num_threads(), n_ctx=max(len(p.ids) for p in peers) + decode_tokens + 8)
        except PeerMissingError as e:
            typer.echo(f"{e}; running the ragkv rows alone", err=True)
        systems = {
            "ragkv fused": ("reuse", "model"),
            "ragkv full": ("full", "model"),
            "ragkv fused, int8 decode": ("reuse", "int8"),
            "ragkv fused, int4 decode": ("reuse", "int4"),
        }

        def progress(name: str, run: Any) -> None:
            typer.echo(f"  {name}: TTFT {run.ttft_s:.2f} s, {run.per_token_s * 1000:.0f} ms/token", err=True)

        with busy_processes(busy):
            rows = run_peer_bench(
                engine, systems, peers, llm=llm, repeats=repeats, decode_tokens=decode_tokens, on_run=progress
            )
        engine.close()
    tokens = sorted(len(p.ids) for p in peers)
    typer.echo(format_peer_table(rows))
    typer.echo(
        f"{len(peers)} prompts of {tokens[0]}-{tokens[-1]} tokens, {repeats} rounds, {busy} busy processes beside; "
        f"{machine_load()}"
    )
    anatomy = decode_anatomy(adapter, list(peers[0].ids), steps=decode_tokens)
    typer.echo(format_table(anatomy, ANATOMY_COLUMNS))
    _write_rows(rows + anatomy, out)


@bench_app.command("codec")
def bench_codec(
    prompts: Prompts = "builtin",
    model: Model = None,
    out: JsonOut = None,
    limit: Annotated[int, typer.Option("--limit")] = 6,
    plot: Annotated[Path | None, typer.Option("--plot", help="Save a size vs KL plot here.")] = None,
    calibrate: Annotated[
        str | None,
        typer.Option(
            "--calibrate",
            help="Also measure cachegen in a channel transform calibrated on prompts 4-7 of this set "
            "(rows cachegen+klt); calibrate on a set you do not report on.",
        ),
    ] = None,
) -> None:
    """Size, fidelity and speed of every codec and level."""
    from ragkv.bench.codec import calibrate_transform, format_table, plot_rows, run_codec_bench

    adapter = _load_model(model)
    transform = None
    if calibrate is not None:
        transform = calibrate_transform(adapter, _bench_prompts(calibrate, adapter, 8, max_tokens=2000)[4:])
        layers = [sum(flags) for flags in transform.enabled]
        typer.echo(
            f"channel transform: keys in {layers[0]}, values in {layers[1]} of {len(transform.enabled[0])} layers"
        )
    rows = run_codec_bench(adapter, _bench_prompts(prompts, adapter, limit, max_tokens=2000), transform=transform)
    typer.echo(format_table(rows))
    _write_rows(rows, out)
    if plot:
        plot_rows(rows, plot)


@bench_app.command("store")
def bench_store(
    store: Annotated[str, typer.Option("--store", help="Tier URLs, comma-separated.")] = "memory://",
    out: JsonOut = None,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Also time assembling k chunks' caches from each tier against prefilling them."),
    ] = None,
    k: Annotated[int, typer.Option("--k", help="Chunks to assemble.")] = 4,
    codec_name: Annotated[str, typer.Option("--codec")] = "raw",
    level: Annotated[int, typer.Option("--level")] = 0,
) -> None:
    """Put/get throughput and latency per tier for chunk-sized blobs (and assembly vs prefill)."""
    from ragkv.bench.store import format_table, run_store_bench

    urls = [u for u in store.split(",") if u]
    rows = run_store_bench(urls)
    typer.echo(format_table(rows))
    if model:
        from ragkv.bench.assemble import format_assemble_table, run_assemble_bench

        assembled = run_assemble_bench(_load_model(model), urls, k=k, codec_name=codec_name, level=level)
        typer.echo("\n" + format_assemble_table(assembled))
        rows = rows + assembled
    _write_rows(rows, out)


@bench_app.command("stream")
def bench_stream(
    model: Model = None,
    out: JsonOut = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Save a TTFT vs bandwidth plot here.")] = None,
    levels: Annotated[str, typer.Option("--levels", help="cachegen levels stored, best first.")] = "0,1,2,3",
    chunks: Annotated[int, typer.Option("--chunks", help="Chunks in the prompt.", min=1)] = 4,
    repeats: Annotated[int, typer.Option("--repeats", help="Runs per (scenario, policy); the best is kept.")] = 3,
    slo_ms: SloMs = None,
    scenarios: Annotated[
        str | None,
        typer.Option(
            "--scenarios",
            help="Comma-separated subset of 10mbit,100mbit,1gbit,unlimited,drop-1gbit-20mbit (default: all).",
        ),
    ] = None,
) -> None:
    """TTFT and KL of fixed levels, text and the load planner over a kernel-limited link to Redis.

    Runs in a network namespace it creates (unshare -n, tbf on loopback; needs root).
    """
    from ragkv.bench import netns

    if not netns.inside():
        try:
            code = netns.reexec_inside(["-m", "ragkv.cli", *sys.argv[1:]])
        except RuntimeError as e:  # no namespace here: say why, in one line
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(code)
    from ragkv.bench.stream import SCENARIOS, format_table, plot_rows, run_stream_bench, summary

    wanted = [int(x) for x in levels.split(",") if x.strip()]
    names = None if scenarios is None else [x.strip() for x in scenarios.split(",") if x.strip()]
    known = [name for name, *_ in SCENARIOS]
    if names is not None and (unknown := sorted(set(names) - set(known))):
        typer.echo(f"error: unknown scenario(s) {unknown}; choose from {','.join(known)}", err=True)
        raise typer.Exit(2)
    rows = run_stream_bench(_load_model(model), wanted, chunks=chunks, repeats=repeats, slo_ms=slo_ms, scenarios=names)
    typer.echo(format_table(rows))
    typer.echo("\n" + summary(rows))
    _write_rows(rows, out)
    if plot:
        plot_rows(rows, plot)


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
    import httpx

    from ragkv.bench.serve import format_serve_table, run_serve_bench
    from ragkv.retriever.corpus import DEMO_QUESTIONS, stdlib_corpus

    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=3600) as client:
        if not client.get("/v1/documents").raise_for_status().json()["data"]:
            typer.echo("indexing the stdlib demo documents on the server ...", err=True)
            docs = [{"source": d.source, "text": d.text, "title": d.title} for d in stdlib_corpus()]
            _index_on_server(client, docs)
    rows = run_serve_bench(url, levels, requests, questions=DEMO_QUESTIONS, api_key=api_key, max_tokens=max_tokens)
    typer.echo(format_serve_table(rows))
    _write_rows(rows, out)


@bench_app.command("vllm")
def bench_vllm(
    questions: Annotated[int, typer.Option("--questions", help="RAG prompts (one per QA question).", min=1)] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens of the end-to-end request.", min=1)] = 32,
    docs: Annotated[int, typer.Option("--docs", help="QA documents indexed.", min=1)] = 10,
    ratio: Annotated[
        float | None, typer.Option("--ratio", help="Fusion ratio (share of chunk tokens recomputed) [ragkv's].")
    ] = None,
    model_folder: Annotated[
        str | None, typer.Option("--model-folder", help="A model folder vLLM loads [ragkv's default, converted].")
    ] = None,
    out: JsonOut = None,
) -> None:
    """TTFT and end-to-end time of vLLM alone vs vLLM with ragkv's KV connector, same prompts and engine.

    Runs in vLLM's own virtual environment (bash tools/vllm_env.sh --no-test builds it).
    """
    from ragkv.bench.table import Column, format_table
    from ragkv.bench.vllm import VllmBenchConfig, VllmMissingError, require_vllm, run_vllm_bench

    try:
        require_vllm()
        cfg = VllmBenchConfig(questions, max_tokens, docs, ratio, model_folder)
    except VllmMissingError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    rows, summary = run_vllm_bench(cfg, echo=lambda line: typer.echo(line, err=True))
    typer.echo(format_table(rows, [Column(k) for k in rows[0]]))
    typer.echo(
        f"median TTFT: vLLM {summary['median_ttft_vllm_ms']:.0f} ms, "
        f"vLLM + connector {summary['median_ttft_connector_ms']:.0f} ms; warm-up {summary['warm_up_s']} s"
    )
    steps = ", ".join(f"{k} {v:.0f}" for k, v in summary["step_ms"].items())
    typer.echo(f"connector steps per request (ms, ragkv in {summary['ragkv_dtype']}): {steps}")
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
    import httpx

    from ragkv.bench.soak import format_soak, run_soak
    from ragkv.retriever.corpus import DEMO_QUESTIONS, stdlib_corpus

    keys: list[str | None] = list(api_key) if api_key else [None]
    for key in keys:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=3600) as client:
            if not client.get("/v1/documents").raise_for_status().json()["data"]:
                typer.echo("indexing the stdlib demo documents on the server ...", err=True)
                docs = [{"source": d.source, "text": d.text, "title": d.title} for d in stdlib_corpus()]
                _index_on_server(client, docs)
    result = run_soak(url, keys, DEMO_QUESTIONS, minutes=minutes, concurrency=concurrency, max_tokens=max_tokens,
                      pid=pid)  # fmt: skip
    table, rows = format_soak(result, minutes)
    typer.echo(table)
    _write_rows(rows, out)


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
