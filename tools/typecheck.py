"""Type-check ragkv as it is installed: ``python tools/typecheck.py [MYPY_ARGS...]`` (what ``make lint`` runs).

``python tools/typecheck.py --layout DEST`` copies the package laid out as installed into ``DEST`` instead
(what ``tools/gpu_check.sh`` runs from on a machine with no install of ragkv).

pyproject.toml installs the root folders as subpackages (``package-dir``: ``ragkv.codec`` is ``codec/``,
``ragkv.cache`` is ``cache/``, ...). mypy cannot read that mapping, and the editable install is an import
hook it does not run, so on the plain checkout ``ragkv.codec`` does not exist for it: with missing imports
ignored every cross-package call was ``Any`` and a wrong call such as ``Catalog(123)`` passed. This script
lays the package out as installed, as a tree of symlinks under ``.typecheck/`` (``.typecheck/ragkv/codec``
links to ``codec/``), which ``[tool.mypy] mypy_path`` puts first on mypy's search path; mypy then checks
the real sources, and the reported paths are mapped back to the files you edit (``codec/api.py:12``).

The tree is rebuilt on every run, so files added, moved or deleted since the last run are seen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ".typecheck"  # pyproject.toml's [tool.mypy] mypy_path names the same folder
# Checked besides the package: scripts that import it (each a top-level module to mypy).
EXTRA_TARGETS = ("experiments", "examples", "tools")
_SKIP = {"__pycache__"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each mapped package's name and source folder, from pyproject.toml's ``[tool.setuptools.package-dir]``.

    >>> package_dirs()["ragkv.codec"].name
    'codec'
    """
    with (root / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def build_tree(root: Path = ROOT, dest: Path | None = None) -> Path:
    """Lay the packages out as installed, as relative symlinks under ``dest``, and return ``dest``.

    A package with mapped subpackages (``ragkv``) becomes a real folder holding one link per entry of its
    source folder plus one link per mapped subpackage; any other package is a single link to its folder.

    Args:
        root: the repository root (holds pyproject.toml).
        dest: where to build; ``root / ".typecheck"`` by default. Emptied first.
    """
    dest = root / TREE if dest is None else dest
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        shutil.rmtree(dest)
    dirs = package_dirs(root)
    for name in sorted(dirs, key=lambda n: n.count(".")):  # parents before the subpackages inside them
        source, target = dirs[name], dest.joinpath(*name.split("."))
        if not source.is_dir():
            raise FileNotFoundError(f"package-dir maps {name!r} to {source}, which is not a folder; fix pyproject.toml")
        nested = {n[len(name) + 1 :] for n in dirs if n.startswith(name + ".") and n.count(".") == name.count(".") + 1}
        if not nested:
            _link(source, target)
            continue
        target.mkdir(parents=True)
        for entry in sorted(source.iterdir()):
            if entry.name not in _SKIP and entry.name not in nested:
                _link(entry, target / entry.name)
    return dest


def copy_tree(dest: Path, root: Path = ROOT) -> Path:
    """Copy the packages laid out as installed into ``dest`` (real files, no links), and return it.

    What a machine with no install of ragkv runs from (``tools/gpu_check.sh`` on a lent GPU): a plain
    checkout on the path has no ``ragkv.codec``. ``dest`` must not exist yet.
    """
    links = build_tree(root, dest.parent / f".{dest.name}.links")
    try:
        dest.mkdir(parents=True)
        for entry in links.iterdir():
            shutil.copytree(entry, dest / entry.name, symlinks=False, ignore=shutil.ignore_patterns(*_SKIP))
    finally:
        shutil.rmtree(links)
    return dest


def _link(source: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(source, link.parent), target_is_directory=source.is_dir())


def path_map(tree: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(folder in ``tree``, source folder) prefixes per mapped package, deepest first, both relative to ``root``.

    >>> ("tree/ragkv/codec/", "codec/") in path_map(Path("tree"))
    True
    """
    dirs = sorted(package_dirs(root).items(), key=lambda item: -item[0].count("."))
    return [
        ((tree / Path(*name.split("."))).as_posix() + "/", Path(os.path.relpath(source, root)).as_posix() + "/")
        for name, source in dirs
    ]


def real_path(line: str, prefixes: Sequence[tuple[str, str]]) -> str:
    """Rewrite a mypy line that starts with a path inside the tree to the source file behind it.

    >>> real_path(".typecheck/ragkv/codec/api.py:3: error: boom", path_map(Path(".typecheck")))
    'codec/api.py:3: error: boom'
    """
    for in_tree, source in prefixes:
        if line.startswith(in_tree):
            return source + line[len(in_tree) :]
    return line


def mypy_command(targets: Sequence[str], *options: str) -> list[str]:
    """The mypy command line, with the repository's configuration, for ``targets`` (files, folders)."""
    return [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *options, *targets]


def main(argv: Sequence[str] = ()) -> int:
    """Build the tree, run mypy on it and on :data:`EXTRA_TARGETS`, print its report; mypy's exit status.

    ``--layout DEST`` instead copies the packages laid out as installed into ``DEST`` (:func:`copy_tree`).
    """
    if argv[:1] == ["--layout"]:
        if len(argv) != 2:
            print("usage: python tools/typecheck.py --layout DEST (a folder that does not exist yet)", file=sys.stderr)
            return 2
        print(copy_tree(Path(argv[1]).resolve()))
        return 0
    tree = Path(os.path.relpath(build_tree(ROOT), ROOT))
    top = sorted({name.split(".")[0] for name in package_dirs(ROOT)})
    targets = [str(tree / name) for name in top] + [t for t in EXTRA_TARGETS if (ROOT / t).is_dir()]
    prefixes = path_map(tree)
    proc = subprocess.Popen(
        mypy_command(targets, *argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in proc.stdout or ():
        sys.stdout.write(real_path(line, prefixes))  # the report is this tool's output
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
