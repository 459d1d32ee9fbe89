"""The document commands: ``ragkv index``, ``list``, ``stats`` and ``remove``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ragkv.cli.checks import check_setup, documents, indexed_source
from ragkv.cli.options import (
    CatalogUrl,
    DataDir,
    Device,
    Dtype,
    Model,
    Offline,
    Store,
    Tenant,
    config_from,
    engine_config,
)

__all__ = ["register"]


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
    docs = documents(paths)  # before config_from: building the config imports torch and transformers
    cfg = config_from(ctx)
    check_setup(cfg)
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
        pending = cat.pending_entries(cfg.tenant)
        if pending:  # removals a tier could not finish: `ragkv remove SOURCE` again finishes them
            typer.echo(
                f"{len(pending)} cache entries of removed documents are pending deletion "
                f"({', '.join(cat.pending_sources(cfg.tenant))}): run `ragkv remove` on them again"
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


def remove(
    source: Annotated[str, typer.Argument(help="The document's source (a path as indexed, or its name).")],
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
) -> None:
    """Remove a document: its catalog rows, FAISS entries and the cache entries no other document uses."""
    # before config: building it imports torch and transformers (a typo must fail at once)
    found = indexed_source({"data_dir": data_dir, "catalog": catalog, "tenant": tenant}, source)
    cfg = engine_config(data_dir=data_dir, model=model, store=store, catalog=catalog, tenant=tenant)
    check_setup(cfg)
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        r = engine.remove(found)
    typer.echo(f"removed {r.source}: {r.chunks} chunks, {r.cache_entries} cache entries")
    if r.pending:
        typer.echo(
            f"error: {r.pending} cache entries could not be deleted (a tier is read-only or unavailable); "
            f"they stay in the catalog as pending: run `ragkv remove {r.source}` again once the tiers can delete",
            err=True,
        )
        raise typer.Exit(1)


def check(
    data_dir: DataDir = None,
    model: Model = None,
    store: Store = None,
    catalog: CatalogUrl = None,
    tenant: Tenant = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="Recompute missing caches, drop dangling rows, retry pending removals.")
    ] = False,
) -> None:
    """Check that the catalog, the FAISS index and the stored caches agree; repair them with --repair.

    Exits 1 when a disagreement is left (without --repair, any found). The FAISS index is rebuilt
    from the catalog whenever it is opened, so that part is repaired by running the check at all.
    """
    from ragkv.cache.catalog import Catalog
    from ragkv.types import tenant_namespace

    cfg = engine_config(data_dir=data_dir, model=model, store=store, catalog=catalog, tenant=tenant)
    check_setup(cfg)
    from ragkv.retriever.check import check as run_check
    from ragkv.retriever.check import faiss_disagreement

    path = cfg.data_dir / f"chunks-{tenant_namespace(cfg.tenant)}.faiss"
    with Catalog(cfg.catalog_url(), create=False) as cat:  # no catalog: one line naming `ragkv index`
        before = faiss_disagreement(cat, cfg.tenant, path)  # as on disk: opening the engine reconciles it
    from ragkv.engine import RagKV

    with RagKV(cfg) as engine:
        r = run_check(engine.retriever, repair=repair, before=before)
    typer.echo(
        f"tenant {cfg.tenant!r}: {r.documents} documents; FAISS: {r.vectors_missing} rows without a vector, "
        f"{r.vectors_stale} vectors without a row (rebuilt from the catalog); {len(r.caches_missing)} chunk "
        f"caches missing, {len(r.entries_dangling)} entries whose blob is gone, {len(r.pending)} pending deletions"
        + (f"; repaired {r.repaired}" if repair else "")
    )
    for what in (*r.caches_missing, *r.entries_dangling, *r.pending):
        typer.echo(f"  {what}")
    left = len(r.caches_missing) + len(r.entries_dangling) + len(r.pending)
    if left or (not repair and r.problems):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add these commands to the ``ragkv`` app."""
    app.command()(index)
    app.command("list")(list_documents)
    app.command()(stats)
    app.command()(remove)
    app.command("check")(check)
