"""The integrations package imports no framework; a missing framework fails with an install hint."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_package_import_pulls_in_no_framework():
    out = run(
        "import sys, ragkv.integrations; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llama_index', 'langchain_core')))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("llamaindex", "llama_index", "llamaindex"),
        ("langchain", "langchain_core", "langchain"),
        ("vllm", "vllm", "vllm"),
    ],
)
def test_missing_framework_raises_an_install_hint(module, blocked, extra):
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        f"try:\n    import ragkv.integrations.{module}\n"
        "except ImportError as e:\n    print(e)\nelse:\n    print('imported')"
    )
    out = run(code)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'ragkv[{extra}]'" in out.stdout
