"""The import direction of ragkv: each room imports only from rooms below it (or itself).

Run by ``make lint`` and by tests/test_layers.py. Every import counts, module level or inside a
function (a lazy import still ties the rooms together); imports under ``if TYPE_CHECKING:`` count
too. The map is docs/architecture.md; change both together.

    python tools/layers.py        # prints the violations, exits 1 if any
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The installed package name of each source folder (pyproject.toml's package-dir mapping).
FOLDERS = {"ragkv": "ragkv", "ragkv.codec": "codec", "ragkv.cache": "cache",
           "ragkv.retriever": "retriever", "ragkv.integrations": "integrations"}  # fmt: skip

# Lowest first. A module may import from its own layer's rooms and from any lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("ragkv.digests", "ragkv.errors", "ragkv.types", "ragkv.locations"),  # records; where data lives
    ("ragkv.codec", "ragkv.cache", "ragkv.prompt"),  # bytes: encode, store; prompt layout
    ("ragkv.model",),  # the generator: loading, conversion, adapter, attention
    (
        "ragkv.gpu",
        "ragkv.selection",
        "ragkv.fusion",
        "ragkv.generation",
        "ragkv.matching",
        "ragkv.planner",
    ),  # algorithms
    ("ragkv.retriever",),  # indexing and loading chunk caches
    ("ragkv.config", "ragkv.answering", "ragkv.driver"),  # the engine's parts: settings, prefill, the answer driver
    ("ragkv.engine",),  # RagKV, the facade
    (
        "ragkv.server",
        "ragkv.replicas",
        "ragkv.bench",
        "ragkv.cli",
        "ragkv.integrations",
        "ragkv",
    ),  # front ends
]
LEVEL = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the package as ``(dotted name, file)``."""
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            yield name, path


def room(module: str) -> str | None:
    """The room (a key of LEVEL) a dotted module belongs to; None for modules outside ragkv."""
    parts = module.split(".")
    if parts[0] != "ragkv":
        return None
    return f"ragkv.{parts[1]}" if len(parts) > 1 else "ragkv"


def imported(tree: ast.AST, known: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every absolute import of ragkv in ``tree``; ``from ragkv import x``
    names ``ragkv.x`` when x is a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if full in known else node.module


def check(sources: dict[str, tuple[str, str]]) -> list[str]:
    """One line per import that points upward (or into a room the map does not know).

    ``sources`` maps each dotted module name to ``(where, code)``: where is named in the lines."""
    known = set(sources)
    out = []
    for name, (where, code) in sources.items():
        here = room(name)
        if here not in LEVEL:
            out.append(f"{where}: room {here} is not in tools/layers.py's LAYERS")
            continue
        for line, target in imported(ast.parse(code), known):
            there = room(target)
            if there is None or there == here:
                continue
            if there not in LEVEL:
                out.append(f"{where}:{line}: imports {target}, whose room is not in LAYERS")
            elif LEVEL[there] > LEVEL[here]:
                out.append(f"{where}:{line}: {here} (layer {LEVEL[here]}) imports {target} "
                           f"(layer {LEVEL[there]}): imports point down only (docs/architecture.md)")  # fmt: skip
    return out


def violations() -> list[str]:
    """:func:`check` over the package as it is on disk."""
    return check({name: (str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")) for name, path in modules()})


def main() -> int:
    bad = violations()
    for line in bad:
        print(line)
    print(f"layers: {len(bad)} upward import(s)" if bad else "layers: imports point down only")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
