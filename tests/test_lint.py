"""The type check sees across the mapped packages: a wrong call into ragkv.codec, ragkv.cache or
ragkv.retriever fails it, as ``make lint`` runs it (tools/typecheck.py: same configuration, same tree).

The planted modules are checked with the package they import, as ``make lint`` checks it (same
options, same cache); the assertions read only the planted modules' lines.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # a cold mypy run over torch and transformers: 1-2 minutes (warm: less)

ROOT = Path(__file__).resolve().parent.parent

# Each wrong call is on a line ending in "# wrong: <mypy error code>".
PLANTED = """
from ragkv import codec
from ragkv.cache.catalog import Catalog
from ragkv.retriever.chunker import Chunker
from ragkv.types import ChunkKV


def wrong(kv: ChunkKV) -> None:
    Catalog(123)  # wrong: arg-type
    codec.encode(kv, 2, "cachegen")  # wrong: arg-type
    Chunker(42)  # wrong: arg-type
"""

CORRECT = """
from collections.abc import Callable

from ragkv import codec
from ragkv.cache.catalog import Catalog
from ragkv.retriever.chunker import Chunker


def right(path: str) -> tuple[Catalog, Chunker, Callable[..., object]]:
    return Catalog(path, timeout_s=5.0), Chunker(len), codec.encode
"""


def _typecheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "tools" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    tmp = tmp_path_factory.mktemp("lint")
    typecheck = _typecheck()
    tree = typecheck.build_tree(ROOT, tmp / "tree")  # not the repo's .typecheck: `make lint` may be rebuilding it
    src = tmp / "src"
    src.mkdir()
    (src / "planted.py").write_text(textwrap.dedent(PLANTED))
    (src / "correct.py").write_text(textwrap.dedent(CORRECT))
    # make lint's options and mypy cache (CI runs make lint first): torch and transformers are
    # analysed already, only the tree's modules are checked again (their paths differ)
    command = typecheck.mypy_command(["planted.py", "correct.py"], "--cache-dir", str(ROOT / ".mypy_cache"))
    env = {**os.environ, "MYPYPATH": str(tree)}  # ahead of the configured mypy_path
    proc = subprocess.run(command, cwd=src, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, src


def test_wrong_calls_across_packages_fail(mypy_report: tuple[int, str, Path]) -> None:
    status, report, src = mypy_report
    assert status == 1, report
    expected = {
        (n, m.group(1))
        for n, line in enumerate((src / "planted.py").read_text().splitlines(), 1)
        if (m := re.search(r"# wrong: ([\w-]+)$", line))
    }
    found = {(int(n), code) for n, code in re.findall(r"^planted\.py:(\d+): error: .*\[([\w-]+)\]$", report, re.M)}
    assert {n for n, _ in found} == {n for n, _ in expected}, report
    assert expected <= found, report  # real type errors, not "module not found"


def test_correct_calls_pass(mypy_report: tuple[int, str, Path]) -> None:
    _, report, _ = mypy_report
    assert not re.search(r"^correct\.py:", report, re.M), report
    assert "import-not-found" not in report and "import-untyped" not in report, report
