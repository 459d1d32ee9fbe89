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
    qa_set: Annotated[
        str | None,
        typer.Option(
            "--qa-set",
            help="QA set: invented (defaults are tuned on it), heldout (never tuned on), "
            "or a JSON file of the same schema [invented].",
        ),
    ] = None,
    dtype: Dtype = None,
    device: Device = None,
) -> None:
    """Answers scored against gold on an invented multi-document QA set, per fusion method."""
    from ragkv.bench.qa import format_qa_table, parse_methods, run_qa_bench
    from ragkv.bench.qa_data import load_qa_set
    from ragkv.model.attention import DECODE_WEIGHTS

    try:
        grid = parse_methods(methods)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--methods") from e
    try:
        qa = load_qa_set(qa_set)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--qa-set") from e
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
        qa,
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
        if partial is not None:  # the run finished: its answers are all in the JSON
            partial.unlink(missing_ok=True)
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
    peer: Annotated[
        str,
        typer.Option(
            "--peer",
            help="How llama.cpp runs: library (llama-cpp-python), server (llama-server, one slot), "
            "auto (the library if installed, else the server if found).",
        ),
    ] = "auto",
    llama_server: Annotated[
        str | None,
        typer.Option("--llama-server", help="The llama-server binary [RAGKV_LLAMA_SERVER, PATH, the build's]."),
    ] = None,
    out: JsonOut = None,
) -> None:
    """ragkv (fused, full, each decode copy) against llama.cpp on the same GGUF and prompt token ids.

    Both sides run --threads threads (ragkv: RAGKV_THREADS, unless set; with --busy, ragkv's follow
    RAGKV_THREADS=auto: the cores other processes leave free).
    """
    import tempfile

    import torch

    from ragkv.bench.peer import (
        ANATOMY_COLUMNS,
        ServerPeer,
        bench_engine,
        busy_processes,
        decode_anatomy,
        format_peer_table,
        gguf_path,
        machine_load,
        peer_prompts,
        run_peer_bench,
    )
    from ragkv.bench.table import format_table
    from ragkv.model.attention import DECODE_WEIGHTS
    from ragkv.model.placement import resolve_decode_weights
    from ragkv.model.quant import time_formats

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        torch.set_num_threads(threads)
    if not busy:  # llama-server is another process: under auto, its busy cores would read as others' load
        os.environ.setdefault("RAGKV_THREADS", str(torch.get_num_threads()))
    try:
        gguf = gguf_path(model or engine_config().model)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from e
    adapter = _load_model(str(gguf), dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="ragkv-peer-") as tmp:
        engine = bench_engine(adapter, "model", Path(tmp))
        peers = peer_prompts(engine, _bench_prompts(prompts, adapter, limit, max_tokens=2800))
        n_ctx = max(len(p.ids) for p in peers) + decode_tokens + 8
        llm = _peer(peer, llama_server, gguf, torch.get_num_threads(), n_ctx, Path(tmp))
        # the first two rows run the defaults (decode_weights=auto: int8 for a quantized file on the CPU)
        default, _ = resolve_decode_weights(
            "auto", adapter.device, adapter.weight_bits, timer=lambda formats: time_formats(adapter.model, formats)
        )
        systems = {"ragkv fused": ("reuse", default), "ragkv full": ("full", default)}
        systems |= {f"ragkv fused, {w} decode": ("reuse", w) for w in DECODE_WEIGHTS if w != default}

        def progress(name: str, run: Any) -> None:
            typer.echo(f"  {name}: TTFT {run.ttft_s:.2f} s, {run.per_token_s * 1000:.0f} ms/token", err=True)

        try:
            with busy_processes(busy):
                rows = run_peer_bench(
                    engine, systems, peers, llm=llm, repeats=repeats, decode_tokens=decode_tokens, on_run=progress
                )
        finally:
            if isinstance(llm, ServerPeer):
                llm.close()
            engine.close()
    tokens = sorted(len(p.ids) for p in peers)
    typer.echo(format_peer_table(rows))
    typer.echo(
        f"{len(peers)} prompts of {tokens[0]}-{tokens[-1]} tokens, {repeats} rounds, {busy} busy processes beside; "
        f"llama.cpp: {llm.name if llm is not None else 'not run'}; {machine_load()}"
    )
    anatomy = decode_anatomy(adapter, list(peers[0].ids), steps=decode_tokens)
    typer.echo(format_table(anatomy, ANATOMY_COLUMNS))
    _write_rows(rows + anatomy, out)


def _peer(kind: str, binary: str | None, gguf: Path, threads: int, n_ctx: int, tmp: Path) -> Any:
    """llama.cpp for ``bench peer``: ``kind`` library, server or auto; None (ragkv alone) when auto finds neither."""
    from ragkv.bench.goodput_servers import LlamaServerMissingError, ServerStartError, find_llama_server
    from ragkv.bench.peer import LibraryPeer, PeerMissingError, ServerPeer, load_llama

    if kind not in ("auto", "library", "server"):
        raise typer.BadParameter(f"expected auto, library or server, got {kind!r}", param_hint="--peer")
    if kind in ("auto", "library"):
        try:
            return LibraryPeer(load_llama(gguf, threads, n_ctx=n_ctx))
        except PeerMissingError as e:
            if kind == "library":
                raise typer.BadParameter(str(e), param_hint="--peer") from e
    try:
        path = find_llama_server(binary)
    except LlamaServerMissingError as e:
        if kind == "server":
            raise typer.BadParameter(str(e), param_hint="--llama-server") from e
        typer.echo(f"neither llama-cpp-python nor llama-server was found ({e}); running the ragkv rows alone", err=True)
        return None
    try:
        return ServerPeer(path, gguf, threads, n_ctx, tmp / "llama-server.log")
    except ServerStartError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from e


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


def rerun_in_namespace() -> None:
    """Outside the rate-limited network namespace, run this very command again inside one and exit
    with its code (no namespace here: say why, in one line, exit 2); inside it, return."""
    from ragkv.bench import netns

    if netns.inside():
        return
    try:
        code = netns.reexec_inside(["-m", "ragkv.cli", *sys.argv[1:]])
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


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
    rerun_in_namespace()
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


# the commands that start servers live beside this file; importing it registers them on bench_app
import ragkv.cli.bench_replicas  # noqa: E402,F401  (ragkv bench replicas: Ray Serve)
from ragkv.cli import bench_servers  # noqa: E402,F401
