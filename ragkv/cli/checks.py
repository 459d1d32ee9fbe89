"""Checks the CLI runs before any model loads (a typo must not cost a model load, 30 s and more),
and its one way of failing: one line on stderr saying what to change, exit 2."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import typer

from ragkv.cli.options import engine_config

__all__ = ["catalog_of", "check_indexed", "check_setup", "documents", "engine", "fail", "indexed_source"]


def engine(**options: Any) -> Any:
    from ragkv.engine import RagKV

    return RagKV(engine_config(**options))


def fail(message: str) -> NoReturn:
    """One line on stderr saying what to change, exit 2: the CLI's answer to every bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def check_setup(cfg: Any) -> None:
    """The data directory, the store URLs and the embedder's files, checked without connecting or loading."""
    from ragkv.cache.config import TierConfig
    from ragkv.cache.registry import tier_class
    from ragkv.retriever.embedder import resolve_model_dir

    if cfg.data_dir.exists() and not cfg.data_dir.is_dir():
        fail(f"--data-dir {cfg.data_dir} is a file; pass a directory (it holds the catalog, index and caches)")
    for url in cfg.store_urls():
        tier_class(TierConfig.from_url(url).scheme)  # unknown scheme, bad option, missing backend package
    resolve_model_dir(cfg.embedder)  # its package missing: the install command, before the generator loads


def catalog_of(options: dict[str, Any]) -> tuple[str, str, str]:
    """(catalog URL, tenant, how the user named the catalog) from a command's options and the
    ``RAGKV_*`` variables, as ``EngineConfig`` resolves them, without importing the engine (torch
    and transformers take 10-40 s to import: a bad input must fail before)."""
    from ragkv.locations import default_catalog_url, default_data_dir
    from ragkv.types import DEFAULT_TENANT

    data_dir = Path(options.get("data_dir") or default_data_dir()).expanduser()
    catalog = options.get("catalog") or os.environ.get("RAGKV_CATALOG") or None
    tenant = options.get("tenant") or os.environ.get("RAGKV_TENANT") or DEFAULT_TENANT
    where = f"--data-dir {data_dir}" if catalog is None else f"--catalog {catalog}"
    return catalog or default_catalog_url(data_dir), tenant, where


def check_indexed(options: dict[str, Any]) -> None:
    """Refuse a question when the tenant has nothing indexed: an empty index answers from nothing.

    Runs on the command's options (see :func:`catalog_of`), before the engine's modules load."""
    from ragkv.cache.catalog import Catalog
    from ragkv.types import validate_tenant

    url, tenant, where = catalog_of(options)
    validate_tenant(tenant)
    with Catalog(url, create=False) as cat:  # no catalog: one line naming `ragkv index`
        if not cat.documents(tenant):
            fail(
                f"nothing is indexed for tenant {tenant!r} in {cat.url}: run `ragkv index PATH ...` "
                f"first (with the same {where}{'' if tenant == 'default' else ' --tenant ' + tenant}), "
                "or pass the --data-dir it was built in"
            )


def indexed_source(options: dict[str, Any], source: str) -> str:
    """The catalog's name for ``source`` as typed (a name, or a path indexed under its resolved form),
    from the command's options (see :func:`catalog_of`: before the engine's modules load)."""
    from ragkv.cache.catalog import Catalog
    from ragkv.types import validate_tenant

    url, tenant, _ = catalog_of(options)
    validate_tenant(tenant)
    names = dict.fromkeys([source.strip(), str(Path(source.strip()).expanduser().resolve())])
    with Catalog(url, create=False) as cat:
        found = [n for n in names if n and cat.get_document(n, tenant) is not None]
        # a removal a tier could not finish: removing it again finishes it
        found += [n for n in names if n and not found and cat.pending_entries(tenant, n)]
    if not found:
        fail(f"no document {source.strip()!r} in tenant {tenant!r}; `ragkv list` shows the indexed documents")
    return found[0]


def documents(paths: list[Path]) -> list[Any]:
    """The documents under ``paths``, read before any model loads (a missing path fails at once)."""
    from ragkv.retriever.documents import load_documents

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}; pass existing files or directories to index")
    return load_documents(paths)  # an empty file or a folder without text files: ValueError, one line
