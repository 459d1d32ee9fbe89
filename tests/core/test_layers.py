"""Import direction: nothing in ragkv's core imports ``ragkv.integrations`` (imports parsed with ast).

The core is every folder installed as part of ``ragkv`` except ``integrations/`` (pyproject's
package-dir maps ``codec/``, ``cache/`` and ``retriever/`` in as ``ragkv.codec`` and so on).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ("ragkv", "codec", "cache", "retriever")
FORBIDDEN = "ragkv.integrations"


def integration_imports(source: str) -> list[str]:
    """The modules under ``ragkv.integrations`` that ``source`` imports, wherever the import sits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found += [n for n in names if n == FORBIDDEN or n.startswith(FORBIDDEN + ".")]
    return found


def test_the_checker_sees_every_form_of_import():
    planted = """
import ragkv.integrations._bridge
from ragkv.integrations import langchain
from ragkv import integrations
def later():
    from ragkv.integrations._bridge import engine_state
"""
    assert len(set(integration_imports(planted))) == 4
    assert integration_imports("from ragkv.matching import ChunkRegistry\nimport ragkv.integrationsx\n") == []


# Benchmarks are front ends beside the integrations (tools/layers.py puts both in its top layer):
# `ragkv bench vllm` drives the vLLM connector. Every other core module stays below them.
FRONT_ENDS_BESIDE = ("ragkv/bench/",)


def test_core_modules_never_import_the_integrations():
    files = [
        p
        for folder in CORE
        for p in sorted((ROOT / folder).rglob("*.py"))
        if not str(p.relative_to(ROOT)).startswith(FRONT_ENDS_BESIDE)
    ]
    assert len(files) > 50  # the core was found
    offenders = {
        str(p.relative_to(ROOT)): hits for p in files if (hits := integration_imports(p.read_text(encoding="utf-8")))
    }
    assert offenders == {}, f"core modules import ragkv.integrations (move what they need below it): {offenders}"
