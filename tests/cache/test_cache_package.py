"""Package-wide rules: no torch in ragkv.cache, doctests pass, one public class per module."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import ragkv.cache

MODULES = sorted(m.name for m in pkgutil.iter_modules(ragkv.cache.__path__, "ragkv.cache."))


def test_cache_never_imports_torch() -> None:
    code = (
        "import sys\n"
        f"for name in {MODULES!r}: __import__(name)\n"
        "from ragkv.cache.catalog import Catalog\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.parametrize("name", MODULES)
def test_at_most_one_public_class_per_module(name: str) -> None:
    module = importlib.import_module(name)
    own = [
        n
        for n, obj in vars(module).items()
        if inspect.isclass(obj) and obj.__module__ == name and not n.startswith("_")
    ]
    assert len(own) <= 1, own
