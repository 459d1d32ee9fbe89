"""The layout contract: every subpackage imports as ragkv.* from an editable install and a wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["ragkv", "ragkv.codec", "ragkv.cache", "ragkv.retriever", "ragkv.integrations", "ragkv.bench"]


def test_editable_install_imports_every_subpackage():
    code = "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    out = subprocess.run([sys.executable, "-c", code, *SUBPACKAGES], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    import ragkv.cache

    assert Path(ragkv.cache.__file__).resolve().parent == ROOT / "cache"


def test_built_wheel_contains_and_imports_every_subpackage(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    wheel = next(tmp_path.glob("ragkv-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in SUBPACKAGES:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert "ragkv/py.typed" in names
    assert "ragkv/bench/data/qa_invented.json" in names  # the QA set of ragkv bench qa
    # import from the unpacked wheel alone (no repo on the path)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]; import ragkv; print(ragkv.__file__)"
    )
    env_out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}", *SUBPACKAGES],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
    )
    assert env_out.returncode == 0, env_out.stderr
    assert env_out.stdout.strip().startswith(str(target))


def test_library_code_never_unpickles():
    import re

    pattern = re.compile(r"(pickle|cPickle|dill)\.loads?\(|torch\.load\(")
    for d in ("ragkv", "codec", "cache", "retriever", "integrations"):
        for f in (ROOT / d).rglob("*.py"):
            assert not pattern.search(f.read_text()), f
