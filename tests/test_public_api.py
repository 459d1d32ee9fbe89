"""The package root: a small public API (``from ragkv import RagKV, EngineConfig``) that imports cheaply."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ragkv

ROOT = Path(__file__).resolve().parents[1]


def test_import_ragkv_loads_neither_torch_nor_transformers():
    heavy = "('torch', 'transformers', 'sentence_transformers')"
    code = f"import sys, ragkv; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("name", sorted(set(ragkv.__all__) - {"__version__"}))
def test_every_public_name_is_the_defining_modules_object(name):
    value = getattr(ragkv, name)
    module = importlib.import_module(ragkv._LAZY.get(name) or value.__module__)
    assert getattr(module, name) is value


def test_the_documented_import_works_and_dir_lists_the_api():
    from ragkv import EngineConfig, RagKV

    assert RagKV.__name__ == "RagKV" and EngineConfig().tenant == "default"
    assert set(ragkv.__all__) <= set(dir(ragkv))


def test_unknown_names_raise_attribute_error_and_submodules_still_import():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ragkv.Nope  # noqa: B018
    from ragkv import codec

    assert codec.__name__ == "ragkv.codec"


def test_version_is_the_projects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert ragkv.__version__ == project["version"]
