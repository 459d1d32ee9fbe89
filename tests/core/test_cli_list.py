"""``ragkv list`` (from the catalog alone), ``ragkv --version`` and help texts printed as written."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

import ragkv
from ragkv.cache.catalog import Catalog, DocumentRecord
from ragkv.types import Chunk
from tests.core.test_cli import one_line_error, run
from tests.core.test_cli_preflight import no_model_loads  # noqa: F401  (autouse: listing loads no model)


def index_rows(data_dir, tenant: str = "default") -> None:
    """Two documents as ``ragkv index`` records them: a.txt with chunks of 3 and 2 tokens, b.md with 4."""
    with Catalog(f"sqlite:///{data_dir / 'catalog.db'}") as cat:
        for source, digit, tokens in (("/docs/a.txt", "a", [(1, 2, 3), (4, 5)]), ("/docs/b.md", "b", [(6, 7, 8, 9)])):
            doc_id = digit * 64
            doc = DocumentRecord(doc_id, tenant, source, "c" * 64, source.upper(), len(tokens))
            chunks = [Chunk(f"{i}" * 64, doc_id, i, "text", t, source) for i, t in enumerate(tokens)]
            cat.replace_document(doc, chunks)


def test_list_shows_each_document_with_chunks_and_tokens(monkeypatch, capsys, tmp_path):
    before = datetime.now().timestamp()
    index_rows(tmp_path)
    code, out, _ = run(monkeypatch, capsys, "list", "--data-dir", str(tmp_path))
    assert code == 0
    header, a, b, total = out.splitlines()
    assert header.split()[:3] == ["document", "chunks", "tokens"]
    assert a.split()[:3] == ["/docs/a.txt", "2", "5"] and b.split()[:3] == ["/docs/b.md", "1", "4"]
    assert total.startswith("2 documents, 3 chunks, 9 tokens")
    when = datetime.strptime(" ".join(a.split()[3:5]), "%Y-%m-%d %H:%M")
    assert when.timestamp() >= before - 60


def test_list_json_is_machine_readable(monkeypatch, capsys, tmp_path):
    index_rows(tmp_path)
    code, out, _ = run(monkeypatch, capsys, "list", "--data-dir", str(tmp_path), "--json")
    rows = json.loads(out)
    assert code == 0 and [(r["source"], r["chunks"], r["tokens"]) for r in rows] == [
        ("/docs/a.txt", 2, 5),
        ("/docs/b.md", 1, 4),
    ]
    assert rows[0]["title"] == "/DOCS/A.TXT" and datetime.fromisoformat(rows[0]["indexed_at"]).tzinfo is not None


def test_list_is_per_tenant(monkeypatch, capsys, tmp_path):
    index_rows(tmp_path, tenant="a")
    code, out, err = run(monkeypatch, capsys, "list", "--data-dir", str(tmp_path), "--tenant", "b", "--json")
    assert code == 0 and json.loads(out) == []
    code, out, err = run(monkeypatch, capsys, "list", "--data-dir", str(tmp_path), "--tenant", "b")
    assert code == 0 and out == "" and "ragkv index" in err


def test_list_without_a_catalog_is_one_line_and_creates_nothing(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "list", "--data-dir", str(tmp_path / "none"))
    assert "ragkv index" in one_line_error(code, err)
    assert not (tmp_path / "none").exists()


def test_version(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"ragkv {ragkv.__version__}"


@pytest.mark.parametrize("command", ["ask", "index", "serve", "list"])
def test_help_texts_are_printed_as_written(monkeypatch, capsys, command):
    code, out, _ = run(monkeypatch, capsys, command, "--help")
    flat = " ".join(out.split())  # help wraps lines; the words must all be there
    assert code == 0 and "[env RAGKV_DATA_DIR]" in flat and "[env RAGKV_TENANT; default]" in flat
