"""``ragkv`` commands that reject their input do so before torch and transformers are imported
(importing them takes 10-40 s; a typo must cost well under 2 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
from ragkv.cli import main
sys.argv = ["ragkv", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAGKV_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("index", "/no/such/path"), "no such file or directory: /no/such/path"),
        (("ask", "what grows?"), "no catalog at"),
        (("remove", "notes.txt"), "no catalog at"),
    ],
)
def test_rejected_input_fails_before_the_model_libraries_load(tmp_path, args, message):
    code, err = _run(tmp_path, *args)
    assert code == 2, err
    assert message in err
    assert "HEAVY=\n" in err, err  # neither torch nor transformers was imported


def test_ask_on_an_empty_catalog_fails_before_the_model_libraries_load(tmp_path):
    from ragkv.cache.catalog import Catalog

    Catalog(str(tmp_path / "data" / "catalog.db")).close()  # a catalog with no documents
    code, err = _run(tmp_path, "ask", "what grows?")
    assert code == 2 and "nothing is indexed for tenant 'default'" in err, err
    assert "HEAVY=\n" in err, err
