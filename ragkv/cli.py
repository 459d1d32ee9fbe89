"""The ``ragkv`` command line: index, ask, demo, list, stats, remove, serve (bench, models: own modules)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ragkv.cli_bench import bench_app
from ragkv.cli_models import models_app
from ragkv.cli_options import (
    CatalogUrl,
    DataDir,
    Device,
    Dtype,
    Fusion,
    MaxNewTokens,
    Model,
    Offline,
    Ratio,
    SloMs,
    Store,
    Tenant,
    config_from,
    engine_config,
)
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


def _engine(**options: Any) -> Any:
    from ragkv.engine import RagKV

    return RagKV(engine_config(**options))


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
    ctx: typer.Context,
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
    cfg = config_from(ctx)
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
    ctx: typer.Context,
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
    cfg = config_from(ctx)
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
    cfg = engine_config(data_dir=data_dir, model=model, fusion=fusion, ratio=ratio)
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

    cfg = engine_config(data_dir=data_dir, store=store, catalog=catalog, tenant=tenant)
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

    cfg = engine_config(data_dir=data_dir, catalog=catalog, tenant=tenant)
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
    cfg = engine_config(data_dir=data_dir, model=model, store=store, catalog=catalog, tenant=tenant)
    _check_setup(cfg)
    found = _indexed_source(cfg, source)  # before the generator and the embedder load
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        r = engine.remove(found)
    typer.echo(f"removed {r.source}: {r.chunks} chunks, {r.cache_entries} cache entries")


@app.command()
def serve(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option("--host", help="Interface to bind [127.0.0.1: loopback].")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port [8000].")] = None,
    api_keys: Annotated[
        Path | None, typer.Option("--api-keys", help="File of 'KEY TENANT' lines; every request then needs a key.")
    ] = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="Requests decoded together [8].")] = None,
    step_tokens: Annotated[
        int | None,
        typer.Option("--step-tokens", help="Prompt tokens prefilled between two decode steps (0: whole) [256]."),
    ] = None,
    max_queue: Annotated[int | None, typer.Option("--max-queue", help="Requests held before 429 [32].")] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host", help="A Host name to answer besides loopback and --host (repeatable; '*': any)."
        ),
    ] = None,
    max_connections: Annotated[
        int | None, typer.Option("--max-connections", help="Open connections at most; more get 503 [256].")
    ] = None,
    header_timeout: Annotated[
        float | None, typer.Option("--header-timeout", help="Seconds a connection has to send a request head [10].")
    ] = None,
    quota: Annotated[
        list[str] | None,
        typer.Option("--quota", help="Every tenant's quota NAME=VALUE (repeatable; see docs/serving.md)."),
    ] = None,
    log_json: Annotated[
        bool | None, typer.Option("--log-json/--log-text", help="Access log lines as JSON [text; RAGKV_LOG_JSON].")
    ] = None,
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
        from ragkv.server.protocol import header_timeout_protocol
        from ragkv.server.quotas import TenantQuota
        from ragkv.server.settings import ServerSettings, load_api_keys, load_tenant_quotas
    except ImportError as e:
        raise ImportError(f"ragkv serve needs the serve extra: pip install 'ragkv[serve]' ({e})") from e
    from dataclasses import replace

    if log_json is None and os.environ.get("RAGKV_LOG_JSON"):
        log_json = os.environ["RAGKV_LOG_JSON"].lower() in ("1", "true", "yes")
    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "max_batch": max_batch,
        "step_tokens": step_tokens,
        "max_queue": max_queue,
        "allowed_hosts": tuple(allowed_host) if allowed_host else None,
        "max_connections": max_connections,
        "header_timeout_s": header_timeout,
        "log_json": log_json,
        "metrics_key": os.environ.get("RAGKV_METRICS_KEY") or None,
    }
    default_quota = TenantQuota().with_words(quota or [])
    settings = ServerSettings(
        api_keys=load_api_keys(api_keys) if api_keys else {},
        quota=default_quota,
        tenant_quotas=load_tenant_quotas(api_keys, default_quota) if api_keys else {},
        **{k: v for k, v in given.items() if v is not None},
    )
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        typer.echo(
            f"warning: listening on {settings.host} without --api-keys: anyone who can reach it can use it", err=True
        )
    cfg = config_from(ctx)
    _check_setup(cfg)
    from ragkv.engine import RagKV

    engine = RagKV(cfg)
    settings = replace(settings, model_name=Path(engine.adapter.name).name or "ragkv")
    typer.echo(f"ragkv serve: {engine.adapter.name} on http://{settings.host}:{settings.port}", err=True)
    if settings.access_log:
        logging.getLogger("ragkv.server.access").setLevel(logging.INFO)
    uvicorn.run(
        create_app(engine, settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,  # ragkv.server.access writes one line per request (route template, tenant)
        timeout_graceful_shutdown=int(settings.drain_s) + 5,
        timeout_keep_alive=int(settings.keep_alive_s),
        limit_concurrency=settings.max_connections,
        http=header_timeout_protocol(settings.header_timeout_s),
    )


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
