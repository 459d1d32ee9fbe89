"""The layout contract: every subpackage imports as ragkv.* from an editable install and a wheel."""

from __future__ import annotations

import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["ragkv", "ragkv.codec", "ragkv.cache", "ragkv.retriever", "ragkv.integrations", "ragkv.bench"]


def test_editable_install_imports_every_subpackage():
    code = "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    out = subprocess.run([sys.executable, "-c", code, *SUBPACKAGES], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    import ragkv.cache

    assert Path(ragkv.cache.__file__).resolve().parent == ROOT / "cache"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once for this module (no isolation: the venv's setuptools)."""
    folder = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), str(ROOT)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # setuptools warns when a folder of data files inside a package is not declared (the web page once was
    # left out that way): the build must be clean of such warnings
    assert "absent from the `packages` configuration" not in out.stdout + out.stderr
    return next(folder.glob("ragkv-*.whl"))


def test_built_wheel_contains_and_imports_every_subpackage(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in SUBPACKAGES:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert "ragkv/py.typed" in names
    assert "ragkv/bench/data/qa_invented.json" in names  # the QA sets of ragkv bench qa
    assert "ragkv/bench/data/qa_heldout.json" in names
    for page in (ROOT / "ragkv" / "server" / "static").rglob("*"):
        if page.is_file():
            assert page.relative_to(ROOT).as_posix() in names, page
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


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed by pip (no deps: the venv has them) into a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return site


def test_installed_wheel_holds_the_web_page(installed):
    static = ROOT / "ragkv" / "server" / "static"
    shipped = sorted(p.relative_to(static) for p in static.rglob("*") if p.is_file())
    assert shipped and "index.html" in {p.name for p in shipped}
    for name in shipped:
        assert (installed / "ragkv" / "server" / "static" / name).read_bytes() == (static / name).read_bytes()


@pytest.mark.slow  # 20-40 s: the server loads torch, a tiny model and the embedder
def test_installed_wheel_serves_the_web_page(tmp_path, installed):
    """`ragkv serve` run from the installed wheel answers GET / with the web page as shipped."""
    import httpx

    from tests.conftest import env_without_ragkv_settings, make_model, make_tokenizer
    from tests.server.conftest import free_port

    site = installed
    page = (ROOT / "ragkv" / "server" / "static" / "index.html").read_text()
    model = tmp_path / "model"
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(model)
    tok.save_pretrained(model)
    port = free_port()
    # -I: neither the repo (cwd) nor PYTHONPATH; the installed copy goes first, before the editable install
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); import ragkv.cli; "
        "print(ragkv.cli.__file__, flush=True); ragkv.cli.main()"
    )
    args = ["serve", "--port", str(port), "--model", str(model), "--data-dir", str(tmp_path / "data")]
    env = env_without_ragkv_settings(HF_HUB_OFFLINE="1")
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        server = subprocess.Popen(
            [sys.executable, "-I", "-c", code, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err
        )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().decode().startswith(str(site))  # the wheel's copy, not the repo's
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()
            try:
                r = httpx.get(url + "/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        assert r.status_code == 200 and r.text == page
    finally:
        server.terminate()
        server.wait(30)


def test_layout_copy_imports_every_subpackage_without_an_install(tmp_path):
    """``tools/typecheck.py --layout`` (what tools/gpu_check.sh runs from on a lent GPU machine, which has
    no install of ragkv): every subpackage imports from the copy, its files real ones in it. (A plain
    checkout first on the path has no ``ragkv.codec`` there; here the editable install's finder would
    supply it, so that is not checked.)"""
    dest = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "typecheck.py"), "--layout", str(dest)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert (dest / "ragkv" / "bench" / "data" / "qa_heldout.json").is_file()
    assert not list(dest.rglob("__pycache__"))
    # -I: no PYTHONPATH, no user site; the copy first on the path, as the current folder is for `python -m`
    prog = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]);"
        " [importlib.import_module(m) for m in sys.argv[2:]]; import ragkv.codec; print(ragkv.codec.__file__)"
    )
    cmd = [sys.executable, "-I", "-c", prog, str(dest), *SUBPACKAGES]
    got = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path))
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).resolve().parent == (dest / "ragkv" / "codec").resolve()
    # the layout must not exist yet (nothing is overwritten)
    again = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "typecheck.py"), "--layout", str(dest)], capture_output=True, text=True
    )
    assert again.returncode != 0
