"""The ``ragkv`` command line: the app, ``ask`` and ``demo``; the other commands live beside it.

``docs.py`` (index, list, stats, remove), ``serve.py`` (serve), ``bench.py`` (``ragkv bench ...``),
``models.py`` (``ragkv models``); ``options.py`` declares the shared options once, ``checks.py``
the checks that run before any model loads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Annotated

import typer

from ragkv.cli.bench import bench_app
from ragkv.cli.checks import check_indexed, check_setup
from ragkv.cli.docs import register as register_document_commands
from ragkv.cli.models import models_app
from ragkv.cli.options import (
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
from ragkv.cli.serve import register as register_serve
from ragkv.errors import RagkvError, StorageWriteError

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
register_document_commands(app)  # index, list, stats, remove (ragkv/cli/docs.py)
register_serve(app)  # serve (ragkv/cli/serve.py)


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
    if slo_ms is not None and not slo_ms > 0:  # a bad option is said before the data dir is looked at
        raise ValueError(f"slo_ms must be a positive number of milliseconds (or None); got {slo_ms!r}")
    check_indexed(ctx.params)  # before config_from: building the config imports torch and transformers
    cfg = config_from(ctx)
    check_setup(cfg)
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
    check_setup(cfg)
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


# --help lists the commands in the order a user meets them
_ORDER = ("index", "ask", "demo", "list", "stats", "remove", "check", "serve")
app.registered_commands.sort(key=lambda c: _ORDER.index(c.name or c.callback.__name__ if c.callback else ""))


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
    except StorageWriteError as e:  # nothing was committed; not the input's fault
        typer.echo(f"error: {e.strerror or e}", err=True)
        sys.exit(1)
    except (RagkvError, ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except ImportError as e:  # a missing optional package: its message carries the install hint
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:  # a full disk, no permission: what failed, not a traceback
        where = f" ({e.filename})" if e.filename else ""
        typer.echo(f"error: {e.strerror or e}{where}; free space or fix the permissions and run again", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(n) comes back as n
