"""The ``ragkv`` command line: index, ask, demo, stats, bench."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ragkv.cli_models import models_app
from ragkv.errors import RagkvError

try:  # typer >= 0.25 vendors click as typer._click; older ones use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[assignment]

# rich_markup_mode=None: help texts are printed as written; rich markup would swallow "[env RAGKV_...]"
app = typer.Typer(
    help="Precomputed, compressed, shared KV caches for RAG with local models.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)
bench_app = typer.Typer(
    help="Benchmarks (print a table; --json writes rows).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(bench_app, name="bench")
app.add_typer(models_app, name="models")


def _print_version(given: bool) -> None:
    if given:
        from ragkv import __version__

        typer.echo(f"ragkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print ragkv's version and exit."),
    ] = False,
) -> None:
    """Precomputed, compressed, shared KV caches for RAG with local models."""


# Options default to None ("not given"): EngineConfig and its component records hold the defaults,
# written once; the CLI only overrides what the user typed (or what RAGKV_* variables set).
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Index and cache directory [env RAGKV_DATA_DIR].")]
Model = Annotated[
    str | None,
    typer.Option("--model", help="Model alias, local path, .gguf file or hub name [env RAGKV_MODEL; smollm2-135m]."),
]
Store = Annotated[str | None, typer.Option("--store", help="Tier URLs, comma-separated [env RAGKV_STORE].")]
CatalogUrl = Annotated[str | None, typer.Option("--catalog", help="SQLAlchemy URL [env RAGKV_CATALOG].")]
Tenant = Annotated[
    str | None, typer.Option("--tenant", help="Namespace of index and cache entries [env RAGKV_TENANT; default].")
]
Fusion = Annotated[
    str | None, typer.Option("--fusion", help="Fusion method (naive, blend, query_focus, ...; see docs/concepts.md).")
]
Ratio = Annotated[float | None, typer.Option("--ratio", help="Share of chunk tokens to recompute.")]
Dtype = Annotated[
    str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16 [env RAGKV_DTYPE; auto].")
]
Device = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda[:N] or mps [env RAGKV_DEVICE; auto].")]
Offline = Annotated[bool | None, typer.Option("--offline", help="Never download a hub model (like HF_HUB_OFFLINE=1).")]
MaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", help="Cap on answer tokens [128].")]
SloMs = Annotated[
    float | None,
    typer.Option("--slo-ms", help="TTFT deadline in ms: chunk caches load at cheaper levels or as text to meet it."),
]


def _config(
    data_dir: Path | None = None,
    model: str | None = None,
    store: str | None = None,
    catalog: str | None = None,
    tenant: str | None = None,
    fusion: str | None = None,
    ratio: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    offline: bool | None = None,
    slo_ms: float | None = None,
) -> Any:
    """EngineConfig from its defaults, then RAGKV_* variables, then the options the user gave."""
    from dataclasses import replace

    from ragkv.engine import EngineConfig

    cfg = EngineConfig.from_env(
        data_dir=data_dir,
        model=model,
        store=None if store is None else tuple(u.strip() for u in store.split(",") if u.strip()),
        catalog=catalog,
        tenant=tenant,
        dtype=dtype,
        device=device,
        offline=offline or None,
    )
    if fusion is not None:
        cfg = replace(cfg, fusion=replace(cfg.fusion, method=fusion))
    if ratio is not None:
        cfg = replace(cfg, fusion=replace(cfg.fusion, ratio=ratio))
    if top_k is not None:
        cfg = replace(cfg, retriever=replace(cfg.retriever, top_k=top_k))
    if max_new_tokens is not None:
        cfg = replace(cfg, generation=replace(cfg.generation, max_new_tokens=max_new_tokens))
    if slo_ms is not None:
        cfg = replace(cfg, load=replace(cfg.load, slo_ms=slo_ms))
    return cfg


def _engine(**options: Any) -> Any:
    from ragkv.engine import RagKV

    return RagKV(_config(**options))


# ---- checks that run before any model loads: a typo must not cost a model load (30 s and more) ----


def _fail(message: str) -> NoReturn:
    """One line on stderr saying what to change, exit 2: the CLI's answer to every bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_setup(cfg: Any) -> None:
    """The data directory, the store URLs and the embedder's files, checked without connecting or loading."""
    from ragkv.cache.config import TierConfig
    from ragkv.cache.registry import tier_class
    from ragkv.retriever.embedder import resolve_model_dir

    if cfg.data_dir.exists() and not cfg.data_dir.is_dir():
        _fail(f"--data-dir {cfg.data_dir} is a file; pass a directory (it holds the catalog, index and caches)")
    for url in cfg.store_urls():
        tier_class(TierConfig.from_url(url).scheme)  # unknown scheme, bad option, missing backend package
    resolve_model_dir(cfg.embedder)  # its package missing: the install command, before the generator loads


def _check_indexed(cfg: Any) -> None:
    """Refuse a question when the tenant has nothing indexed: an empty index answers from nothing."""
    from ragkv.cache.catalog import Catalog

    where = f"--data-dir {cfg.data_dir}" if cfg.catalog is None else f"--catalog {cfg.catalog}"
    with Catalog(cfg.catalog_url(), create=False) as cat:  # no catalog: one line naming `ragkv index`
        if not cat.documents(cfg.tenant):
            _fail(
                f"nothing is indexed for tenant {cfg.tenant!r} in {cat.url}: run `ragkv index PATH ...` "
                f"first (with the same {where}{'' if cfg.tenant == 'default' else ' --tenant ' + cfg.tenant}), "
                "or pass the --data-dir it was built in"
            )


def _indexed_source(cfg: Any, source: str) -> str:
    """The catalog's name for ``source`` as typed (a name, or a path indexed under its resolved form)."""
    from ragkv.cache.catalog import Catalog

    names = dict.fromkeys([source.strip(), str(Path(source.strip()).expanduser().resolve())])
    with Catalog(cfg.catalog_url(), create=False) as cat:
        found = [n for n in names if n and cat.get_document(n, cfg.tenant) is not None]
    if not found:
        _fail(f"no document {source.strip()!r} in tenant {cfg.tenant!r}; `ragkv list` shows the indexed documents")
    return found[0]


def _documents(paths: list[Path]) -> list[Any]:
    """The documents under ``paths``, read before any model loads (a missing path fails at once)."""
    from ragkv.retriever.documents import load_documents

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        _fail(f"no such file or directory: {', '.join(missing)}; pass existing files or directories to index")
    return load_documents(paths)  # an empty file or a folder without text files: ValueError, one line


@app.command()
def index(
    paths: Annotated[list[Path], typer.Argument(help="Files or directories of text documents.")],
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    dtype: Dtype = None,
    device: Device = None,
    offline: Offline = None,
    ray: Annotated[
        bool, typer.Option("--ray", help="Prefill chunks in Ray actors (needs the ray extra and a shared store).")
    ] = False,
    ray_address: Annotated[
        str | None, typer.Option("--ray-address", help="Ray cluster to use with --ray [RAY_ADDRESS, else a local Ray].")
    ] = None,
    ray_actors: Annotated[
        int | None, typer.Option("--ray-actors", min=1, help="Actors for --ray (default: one per GPU, else per CPU).")
    ] = None,
) -> None:
    """Chunk, embed and precompute the KV caches of documents (unchanged ones cost nothing).

    Exits 1 when some chunk caches could not be stored (no tier accepted them); their documents
    are not recorded, so running the command again retries them.
    """
    cfg = _config(
        data_dir=data_dir, model=model, store=store, catalog=catalog, tenant=tenant,
        dtype=dtype, device=device, offline=offline,
    )  # fmt: skip
    _check_setup(cfg)
    docs = _documents(paths)
    run: dict[str, Any] = {}
    if ray or ray_address is not None or ray_actors is not None:
        from ragkv.retriever.ray_index import RayConfig

        run = {"executor": "ray", "ray": RayConfig(address=ray_address, actors=ray_actors)}
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        r = engine.index(docs, **run)
    typer.echo(
        f"{r.documents} documents ({r.unchanged} unchanged), {r.chunks} new chunks, "
        f"{r.computed} caches computed, {r.reused} reused, {r.bytes_stored / 1e6:.1f} MB stored "
        f"in {r.seconds:.1f} s"
    )
    if r.failed:
        typer.echo(
            f"error: {r.failed} chunk caches could not be stored (no storage tier accepted them); "
            f"{len(r.failed_documents)} documents were not recorded. Check the store (ragkv stats) and run again.",
            err=True,
        )
        for line in r.errors:
            typer.echo(f"  {line}", err=True)
        raise typer.Exit(1)


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    fusion: Fusion = None,
    ratio: Ratio = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve [4].")] = None,
    full: Annotated[bool, typer.Option("--full", help="Prefill everything instead of reusing caches.")] = False,
    max_new_tokens: MaxNewTokens = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print {answer, sources, stats} as JSON.")] = False,
    dtype: Dtype = None,
    device: Device = None,
    offline: Offline = None,
    slo_ms: SloMs = None,
) -> None:
    """Answer a question from the indexed documents, reusing their chunk caches."""
    cfg = _config(
        data_dir=data_dir,
        model=model,
        store=store,
        catalog=catalog,
        tenant=tenant,
        fusion=fusion,
        ratio=ratio,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        dtype=dtype,
        device=device,
        offline=offline,
        slo_ms=slo_ms,
    )
    _check_setup(cfg)
    _check_indexed(cfg)
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        stream = engine.stream(question, mode="full" if full else "reuse")
        if stream.warning:
            typer.echo(f"warning: {stream.warning}", err=True)
        for delta in stream:
            if not as_json:
                typer.echo(delta, nl=False)
        res = stream.result
    sources = [{"source": c.source, "chunk": c.ordinal, "score": c.score} for c in res.sources]
    if as_json:
        typer.echo(json.dumps({"answer": res.text, "sources": sources, "stats": res.stats.as_dict()}))
        return
    s = res.stats
    typer.echo("\n\nsources: " + (", ".join(f"{x['source']}#{x['chunk']}" for x in sources) or "none"))
    typer.echo(
        f"TTFT {s.ttft_ms:.0f} ms | prompt {s.prompt_tokens} tokens | reused {s.reused_tokens}, "
        f"recomputed {s.recomputed_tokens}, prefilled {s.prefilled_chunk_tokens} chunk tokens | "
        f"{s.bytes_loaded / 1e6:.1f} MB loaded"
    )


@app.command()
def demo(
    data_dir: DataDir = None,
    model: Model = None,
    fusion: Fusion = None,
    ratio: Ratio = None,
    questions: Annotated[int, typer.Option("--questions", help="How many demo questions to ask.", min=1)] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Cap on answer tokens.")] = 48,
) -> None:
    """Index Python stdlib documentation and answer questions with cache reuse and with full prefill."""
    from ragkv.generation import GenerationConfig
    from ragkv.retriever.corpus import DEMO_QUESTIONS, stdlib_corpus

    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    cfg = _config(data_dir=data_dir, model=model, fusion=fusion, ratio=ratio)
    _check_setup(cfg)
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        docs = stdlib_corpus()
        typer.echo(f"indexing {len(docs)} stdlib modules' documentation into {engine.config.data_dir} ...")
        r = engine.index(docs)
        typer.echo(f"  {r.chunks} new chunks, {r.computed} caches computed, {r.unchanged} documents unchanged\n")
        engine.answer("warm-up", chunks=[], generation=GenerationConfig(max_new_tokens=1))
        rows = []
        for q in DEMO_QUESTIONS[:questions]:
            chunks = engine.retrieve(q)
            reuse = engine.answer(q, chunks=chunks, generation=gen)
            full = engine.answer(q, chunks=chunks, mode="full", generation=gen)
            rows.append((reuse.stats.ttft_ms, full.stats.ttft_ms))
            s = reuse.stats
            typer.echo(
                f"Q: {q}\n   sources: {', '.join(f'{c.source}#{c.ordinal}' for c in chunks)}"
                f" ({s.prompt_tokens} prompt tokens)"
            )
            typer.echo(
                f"   reuse [{s.fusion}, recomputed {s.recomputed_tokens}/{s.reused_tokens + s.recomputed_tokens}"
                f" chunk tokens] TTFT {s.ttft_ms:7.0f} ms: {reuse.text!r}"
            )
            typer.echo(f"   full prefill                      TTFT {full.stats.ttft_ms:7.0f} ms: {full.text!r}\n")
    mean_r = sum(a for a, _ in rows) / len(rows)
    mean_f = sum(b for _, b in rows) / len(rows)
    typer.echo(f"mean TTFT: reuse {mean_r:.0f} ms, full prefill {mean_f:.0f} ms ({mean_f / mean_r:.1f}x faster)")


@app.command()
def stats(
    data_dir: DataDir = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    all_tenants: Annotated[
        bool, typer.Option("--all-tenants", help="Also show each tier's totals over every tenant.")
    ] = False,
) -> None:
    """Show the tenant's catalog contents and its entries in each storage tier."""
    from ragkv.cache.catalog import Catalog
    from ragkv.cache.store import open_store
    from ragkv.types import tenant_namespace

    cfg = _config(data_dir=data_dir, store=store, catalog=catalog, tenant=tenant)
    with Catalog(cfg.catalog_url(), create=False) as cat:  # a missing catalog is an error, not a new one
        docs, entries = cat.documents(cfg.tenant), cat.entries(cfg.tenant)
        typer.echo(
            f"catalog {cat.url}, tenant {cfg.tenant!r}: {len(docs)} documents, "
            f"{sum(d.num_chunks for d in docs)} chunks, {len(entries)} cache entries "
            f"({sum(e.nbytes for e in entries) / 1e6:.1f} MB, {sum(e.num_tokens for e in entries)} tokens), "
            f"reused {sum(e.hits for e in entries)} times"
        )
    st = open_store(cfg.store_urls())
    try:
        usage = st.usage(tenant_namespace(cfg.tenant))
        typer.echo(f"{'tier':<40}{'entries':>9}{'MB':>9}{'hits':>7}{'misses':>8}{'evictions':>10}{'errors':>8}")
        for name, s in st.stats().items():
            mine = usage.get(name)
            n, mb = ("?", "?") if mine is None else (str(mine[0]), f"{mine[1] / 1e6:.1f}")
            typer.echo(f"{name:<40}{n:>9}{mb:>9}{s.hits:>7}{s.misses:>8}{s.evictions:>10}{s.errors:>8}")
            if all_tenants:
                total = "?" if s.entries is None else str(s.entries)
                tmb = "?" if s.bytes_stored is None else f"{s.bytes_stored / 1e6:.1f}"
                typer.echo(f"{'  (all tenants)':<40}{total:>9}{tmb:>9}")
        typer.echo(
            "(entries and MB are this tenant's in each tier; hits, misses, evictions and errors count this process)"
        )
    finally:
        st.close()


@app.command("list")
def list_documents(
    data_dir: DataDir = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list of {source, title, chunks, tokens, indexed_at}.")
    ] = False,
) -> None:
    """List the tenant's indexed documents: name, chunks, tokens, when indexed (reads only the catalog)."""
    from datetime import UTC, datetime

    from ragkv.cache.catalog import Catalog

    cfg = _config(data_dir=data_dir, catalog=catalog, tenant=tenant)
    with Catalog(cfg.catalog_url(), create=False) as cat:  # no catalog: one line naming `ragkv index`
        docs, url = cat.document_summaries(cfg.tenant), cat.url
    if as_json:
        rows = [
            {
                "source": d.source,
                "title": d.title,
                "chunks": d.num_chunks,
                "tokens": d.num_tokens,
                "indexed_at": datetime.fromtimestamp(d.indexed_at, UTC).isoformat(timespec="seconds"),
            }
            for d in docs
        ]
        typer.echo(json.dumps(rows, indent=1))
        return
    if not docs:
        typer.echo(f"no documents for tenant {cfg.tenant!r} in {url}; add some with `ragkv index PATH ...`", err=True)
        return
    width = max(len("document"), *(len(d.source) for d in docs))
    typer.echo(f"{'document':<{width}}  {'chunks':>7}  {'tokens':>9}  indexed at")
    for d in docs:
        when = datetime.fromtimestamp(d.indexed_at).astimezone().strftime("%Y-%m-%d %H:%M %Z")
        typer.echo(f"{d.source:<{width}}  {d.num_chunks:>7}  {d.num_tokens:>9}  {when}")
    chunks, tokens = sum(d.num_chunks for d in docs), sum(d.num_tokens for d in docs)
    typer.echo(f"{len(docs)} documents, {chunks} chunks, {tokens} tokens (tenant {cfg.tenant!r}, {url})")


@app.command()
def remove(
    source: Annotated[str, typer.Argument(help="The document's source (a path as indexed, or its name).")],
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
) -> None:
    """Remove a document: its catalog rows, FAISS entries and the cache entries no other document uses."""
    cfg = _config(data_dir=data_dir, model=model, store=store, catalog=catalog, tenant=tenant)
    _check_setup(cfg)
    found = _indexed_source(cfg, source)  # before the generator and the embedder load
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        r = engine.remove(found)
    typer.echo(f"removed {r.source}: {r.chunks} chunks, {r.cache_entries} cache entries")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind [127.0.0.1: loopback].")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port [8000].")] = None,
    api_keys: Annotated[
        Path | None, typer.Option("--api-keys", help="File of 'KEY TENANT' lines; every request then needs a key.")
    ] = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Requests decoded together [8].")] = None,
    max_queue: Annotated[int | None, typer.Option("--max-queue", help="Requests held before 429 [32].")] = None,
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    fusion: Fusion = None,
    ratio: Ratio = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve [4].")] = None,
    max_new_tokens: MaxNewTokens = None,
    dtype: Dtype = None,
    device: Device = None,
    offline: Offline = None,
    slo_ms: SloMs = None,
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API (see docs/serving.md)."""
    try:
        import uvicorn

        from ragkv.server.app import create_app
        from ragkv.server.settings import ServerSettings, load_api_keys
    except ImportError as e:
        raise ImportError(f"ragkv serve needs the serve extra: pip install 'ragkv[serve]' ({e})") from e
    from dataclasses import replace

    given: dict[str, Any] = {"host": host, "port": port, "max_batch": max_batch, "max_queue": max_queue}
    settings = ServerSettings(
        api_keys=load_api_keys(api_keys) if api_keys else {}, **{k: v for k, v in given.items() if v is not None}
    )
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        typer.echo(
            f"warning: listening on {settings.host} without --api-keys: anyone who can reach it can use it", err=True
        )
    cfg = _config(
        data_dir=data_dir,
        model=model,
        store=store,
        catalog=catalog,
        tenant=tenant,
        fusion=fusion,
        ratio=ratio,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        dtype=dtype,
        device=device,
        offline=offline,
        slo_ms=slo_ms,
    )
    _check_setup(cfg)
    from ragkv.engine import RagKV

    engine = RagKV(cfg)
    settings = replace(settings, model_name=Path(engine.adapter.name).name or "ragkv")
    typer.echo(f"ragkv serve: {engine.adapter.name} on http://{settings.host}:{settings.port}", err=True)
    uvicorn.run(
        create_app(engine, settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=int(settings.drain_s) + 5,
    )


def _load_model(model: str | None, dtype: str | None = None, device: str | None = None) -> Any:
    """The model the options name, placed as EngineConfig would place it (its defaults, RAGKV_* variables)."""
    from ragkv.bench.table import machine_note
    from ragkv.model import load_model
    from ragkv.model.placement import dtype_name

    cfg = _config(model=model, dtype=dtype, device=device)
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

    adapter = _load_model(model, dtype, device)
    rows = run_fusion_bench(
        adapter,
        _bench_prompts(prompts, adapter, limit, max_tokens=2800),
        parse_grid(methods) if methods else DEFAULT_GRID,
        limit=limit,
    )
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
    dtype: Dtype = None,
    device: Device = None,
) -> None:
    """Answers scored against gold on an invented multi-document QA set, per fusion method."""
    from ragkv.bench.qa import format_qa_table, parse_methods, run_qa_bench

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

    adapter = _load_model(model, dtype, device)
    ids = [i.strip() for i in (only or "").split(",") if i.strip()]
    result = run_qa_bench(
        adapter, methods=grid, limit=limit, only=ids, max_tokens=max_tokens, seed=seed, on_question=progress
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

    cfg = _config(model=model, dtype=dtype)
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


@bench_app.command("peer")
def bench_peer(
    model: Model = None,
    prompts: Prompts = "packages",
    limit: Annotated[int, typer.Option("--limit", help="RAG prompts (about 2K tokens each).")] = 4,
    repeats: Annotated[int, typer.Option("--repeats", help="Interleaved rounds over the prompts.")] = 3,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Tokens timed per answer.")] = 32,
    threads: Annotated[int | None, typer.Option("--threads", help="Threads for both sides [torch's].")] = None,
    dtype: Dtype = None,
    out: JsonOut = None,
) -> None:
    """ragkv (fused, full, int8/int4 decode) against llama.cpp on the same GGUF and prompt token ids."""
    import tempfile

    import torch

    from ragkv.bench.peer import (
        ANATOMY_COLUMNS,
        PeerMissingError,
        bench_engine,
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
        gguf = gguf_path(model or _config().model)
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

        rows = run_peer_bench(
            engine, systems, peers, llm=llm, repeats=repeats, decode_tokens=decode_tokens, on_run=progress
        )
        engine.close()
    tokens = sorted(len(p.ids) for p in peers)
    typer.echo(format_peer_table(rows))
    typer.echo(f"{len(peers)} prompts of {tokens[0]}-{tokens[-1]} tokens, {repeats} rounds; {machine_load()}")
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
) -> None:
    """Size, fidelity and speed of every codec and level."""
    from ragkv.bench.codec import format_table, plot_rows, run_codec_bench

    adapter = _load_model(model)
    rows = run_codec_bench(adapter, _bench_prompts(prompts, adapter, limit, max_tokens=2000))
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


def main() -> None:
    """Entry point: friendly one-line errors for ragkv's own errors and bad arguments."""
    logging.basicConfig(
        level=os.environ.get("RAGKV_LOG", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        # standalone_mode=False: click's usage errors come back here, to be said in one line too
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:  # `ragkv` or `ragkv bench` alone: the help is the answer
        e.show()
        sys.exit(e.exit_code)
    except UsageError as e:
        where = f"`{e.ctx.command_path} --help`" if e.ctx is not None else "`ragkv --help`"
        typer.echo(f"error: {e.format_message()} (see {where})", err=True)
        sys.exit(2)
    except ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C
        typer.echo("aborted", err=True)
        sys.exit(130)
    except (RagkvError, ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ImportError as e:  # a missing optional package: its message carries the install hint
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(n) comes back as n


if __name__ == "__main__":
    main()
