"""``ragkv models``: list and prune the conversion cache (converted GGUF models, see ragkv.model.conversions)."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

models_app = typer.Typer(
    help="Converted models in the cache (RAGKV_MODEL_CACHE, default ~/.cache/ragkv/models): list, prune.",
    invoke_without_command=True,
    rich_markup_mode=None,  # help texts as written (rich markup would swallow "[...]")
)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return "just now"


@models_app.callback()
def list_models(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the entries as JSON.")] = False,
) -> None:
    """List converted models: source, dtype, size on disk, last use."""
    if ctx.invoked_subcommand is not None:
        return
    from ragkv.model.loading import model_cache

    cache = model_cache()
    entries = cache.entries()
    if as_json:
        rows = [
            {
                "name": e.name,
                "dtype": e.dtype,
                "size_bytes": e.size_bytes,
                "last_used": e.last_used,
                "created": e.created,
                "source": e.source,
                "path": str(e.path),
            }
            for e in entries
        ]
        typer.echo(json.dumps({"cache": str(cache.root), "models": rows}, indent=1))
        return
    if not entries:
        typer.echo(f"no converted models in {cache.root}")
        return
    width = max(len(e.name) for e in entries)
    for e in entries:
        typer.echo(f"{e.name:<{width}}  {e.dtype:<9}  {_human(e.size_bytes):>9}  {_ago(e.last_used):>12}  {e.source}")
    total = sum(e.size_bytes for e in entries)
    typer.echo(f"{len(entries)} converted model(s), {_human(total)} in {cache.root}")


@models_app.command("prune")
def prune(
    name: Annotated[
        str | None, typer.Argument(help="Remove the entries converted from this alias, file name or path.")
    ] = None,
    max_size: Annotated[
        str | None,
        typer.Option("--max-size", help="Remove least recently used entries until the rest fit, e.g. 2GB."),
    ] = None,
    remove_all: Annotated[bool, typer.Option("--all", help="Remove every entry.")] = False,
) -> None:
    """Remove converted models, by name or down to a size (RAGKV_MODEL_CACHE_MAX enforces one on every conversion)."""
    from ragkv.cache.config import parse_size
    from ragkv.model.loading import model_cache

    if not (name or max_size or remove_all):
        raise ValueError("say what to prune: a model name, --max-size SIZE (e.g. 2GB) or --all")
    cap = 0 if remove_all else (parse_size(max_size) if max_size else None)
    cache = model_cache()
    removed = cache.prune(name=name, max_bytes=cap)
    if name and not removed and cap is None:
        raise ValueError(f"no converted model named {name!r} in {cache.root}; list them: ragkv models")
    freed = sum(e.size_bytes for e in removed)
    typer.echo(f"removed {len(removed)} converted model(s), {_human(freed)} freed")
