"""Catalog on SQLite (and PostgreSQL, marker ``postgres``): API, tenants, restarts, concurrent writers."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

from ragkv.cache._catalog_dialects import _enable_wal
from ragkv.cache.catalog import Catalog, DocumentRecord, EntryRecord
from ragkv.errors import CatalogError
from tests.cache.cache_testing import document, make_key


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        return url
    return str(tmp_path / "catalog.db")


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    with Catalog(catalog_url) as c:
        yield c


def test_replace_and_read_back_a_document(catalog: Catalog) -> None:
    doc, chunks = document("a.txt", 3)
    rows = catalog.replace_document(doc, chunks)
    assert len(rows) == 3 and rows == sorted(rows)
    assert catalog.get_document("a.txt", "default") == doc
    assert catalog.chunks_by_rows(rows, "default") == chunks
    assert catalog.chunks_for_document(doc.doc_id) == chunks
    assert catalog.all_chunk_rows("default") == rows
    assert catalog.documents("default") == [doc]


def test_chunks_by_rows_keeps_order_and_skips_unknown_rows(catalog: Catalog) -> None:
    doc, chunks = document("a.txt", 4)
    rows = catalog.replace_document(doc, chunks)
    asked = [rows[3], 999_999, rows[0], rows[2]]
    assert [c.ordinal for c in catalog.chunks_by_rows(asked, "default")] == [3, 0, 2]
    assert catalog.chunks_by_rows([], "default") == []


def test_replacing_gives_new_rows_and_never_reuses_old_ones(catalog: Catalog) -> None:
    doc, chunks = document("a.txt", 3)
    old_rows = catalog.replace_document(doc, chunks)
    new_doc, new_chunks = document("a.txt", 2, version="v2")
    new_rows = catalog.replace_document(new_doc, new_chunks)
    assert not set(old_rows) & set(new_rows)
    assert catalog.chunks_by_rows(old_rows, "default") == []
    assert catalog.get_document("a.txt", "default") == new_doc
    assert catalog.all_chunk_rows("default") == new_rows
    assert catalog.remove_document("a.txt", "default") == new_rows
    rows_after = catalog.replace_document(*document("b.txt", 1))
    assert rows_after[0] > max(new_rows)  # deleted ids stay retired: FAISS ids stay unambiguous
    assert catalog.remove_document("missing.txt", "default") == []


def test_tenants_are_kept_apart(catalog: Catalog) -> None:
    a_rows = catalog.replace_document(*document("same.txt", 2, tenant="alice"))
    b_doc, b_chunks = document("same.txt", 3, tenant="bob")
    b_rows = catalog.replace_document(b_doc, b_chunks)
    assert catalog.chunks_by_rows(a_rows + b_rows, tenant="bob") == b_chunks
    assert catalog.all_chunk_rows("alice") == a_rows
    assert catalog.get_document("same.txt", "carol") is None
    assert [d.tenant for d in catalog.documents("bob")] == ["bob"]
    assert catalog.remove_document("same.txt", "alice") == a_rows
    assert catalog.get_document("same.txt", "bob") == b_doc


def test_chunks_for_a_doc_id_held_by_several_tenants_need_the_tenant(catalog: Catalog) -> None:
    doc, chunks = document("x.txt", 2)
    catalog.replace_document(doc, chunks)
    twin = DocumentRecord(doc.doc_id, "bob", "x.txt", doc.content_digest, doc.title, 2)
    catalog.replace_document(twin, chunks)
    with pytest.raises(ValueError, match="tenant="):
        catalog.chunks_for_document(doc.doc_id)
    assert catalog.chunks_for_document(doc.doc_id, tenant="bob") == chunks


def test_replace_document_checks_its_arguments(catalog: Catalog) -> None:
    doc, chunks = document("a.txt", 2)
    with pytest.raises(ValueError, match="num_chunks"):
        catalog.replace_document(doc, chunks[:1])
    other, _ = document("b.txt", 0)
    with pytest.raises(ValueError, match="doc_id"):
        catalog.replace_document(DocumentRecord(other.doc_id, "default", "a.txt", "c", "t", 2), chunks)
    assert catalog.get_document("a.txt", "default") is None
    empty, _ = document("empty.txt", 0)
    assert catalog.replace_document(empty, []) == []


def test_entries_are_recorded_idempotently_and_touched(catalog: Catalog) -> None:
    key = make_key(1)
    fields = {"tenant": "default", "tokens_digest": "t" * 64, "codec": "raw", "level": 0, "num_tokens": 300}
    catalog.record_entry(key, nbytes=1000, **fields)  # type: ignore[arg-type]
    catalog.touch_entries([key, key, make_key(404)])
    catalog.record_entry(key, nbytes=900, **fields)  # type: ignore[arg-type]  # re-encoded
    assert catalog.has_entry(key) and not catalog.has_entry(make_key(2))
    [entry] = catalog.entries("default")
    assert isinstance(entry, EntryRecord)
    assert (entry.storage_key, entry.nbytes, entry.hits, entry.num_tokens) == (key, 900, 1, 300)
    assert entry.last_access >= entry.created_at
    assert catalog.entries("bob") == []
    catalog.remove_entry(key)
    catalog.remove_entry(key)
    assert catalog.entries("default") == []


def test_entry_keys_for_tokens_are_a_tenants_entries_of_those_chunks_at_any_codec(catalog: Catalog) -> None:
    def record(key: str, tenant: str, tokens: str, level: int) -> None:
        catalog.record_entry(
            key, tenant=tenant, tokens_digest=tokens, codec="cachegen", level=level, nbytes=1, num_tokens=1
        )

    record(make_key(1), "default", "a" * 64, 0)
    record(make_key(2), "default", "a" * 64, 1)  # the same chunk at another level (or transform)
    record(make_key(3), "default", "b" * 64, 0)
    record(make_key(4, "alice"), "alice", "a" * 64, 0)  # the same chunk in another tenant
    assert catalog.entry_keys_for_tokens(["a" * 64], "default") == sorted([make_key(1), make_key(2)])
    assert catalog.entry_keys_for_tokens(["a" * 64, "b" * 64, "c" * 64], "default") == sorted(
        [make_key(1), make_key(2), make_key(3)]
    )
    assert catalog.entry_keys_for_tokens(["a" * 64], "alice") == [make_key(4, "alice")]
    assert catalog.entry_keys_for_tokens([], "default") == []


def test_an_entry_must_live_in_its_tenants_namespace(catalog: Catalog) -> None:
    with pytest.raises(ValueError, match="namespace"):
        catalog.record_entry(
            make_key(1, "alice"),
            tenant="bob",
            tokens_digest="t",
            codec="raw",
            level=0,
            nbytes=1,
            num_tokens=1,
        )


def test_a_schema_version_mismatch_is_a_clear_error(catalog_url: str) -> None:
    Catalog(catalog_url).close()
    url = catalog_url if "://" in catalog_url else f"sqlite:///{catalog_url}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE ragkv_meta SET value = '999' WHERE key = 'schema_version'"))
    engine.dispose()
    with pytest.raises(CatalogError, match="schema version 999, this ragkv uses 1"):
        Catalog(catalog_url)


def test_foreign_tables_without_a_version_are_refused(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE ragkv_chunks (x INTEGER)"))
    engine.dispose()
    with pytest.raises(CatalogError, match="no schema version"):
        Catalog(str(tmp_path / "c.db"))


def test_an_unreachable_database_is_a_catalog_error() -> None:
    with pytest.raises(CatalogError, match="127.0.0.1:1"):
        Catalog("postgresql+psycopg://u:secret@127.0.0.1:1/db", timeout_s=1)


def test_unsupported_databases_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported catalog database 'mysql'"):
        Catalog("mysql://u@h/db")


def test_passwords_are_not_shown() -> None:
    with pytest.raises(CatalogError) as info:
        Catalog("postgresql+psycopg://u:secret@127.0.0.1:1/db", timeout_s=1)
    assert "secret" not in str(info.value)


RUN = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.cache.cache_testing import document
    from ragkv.cache.catalog import Catalog
    from ragkv.types import tenant_namespace
    url, action, name, count, go = sys.argv[2:7]
    with Catalog(url) as catalog:
        while not os.path.exists(go):  # start together with the other writer
            time.sleep(0.01)
        if action == "write":
            for i in range(int(count)):
                doc, chunks = document(f"{name}-{i}.txt", 3)
                rows = catalog.replace_document(doc, chunks)
                assert catalog.chunks_by_rows(rows, "default") == chunks
                key = f"{tenant_namespace('default')}/{doc.doc_id}"
                catalog.record_entry(
                    key, tenant="default", tokens_digest="t", codec="raw", level=0, nbytes=i, num_tokens=3
                )
        else:
            print(",".join(str(r) for r in catalog.all_chunk_rows("default")))
    """
)


def run_all(url: str, tmp_path: Path, *jobs: tuple[str, str, int]) -> list[str]:
    """Run catalog jobs (action, name, count) in processes that start work at the same moment."""
    root, go = str(Path(__file__).parents[2]), tmp_path / "go"
    go.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RUN, root, url, action, name, str(count), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for action, name, count in jobs
    ]
    go.touch()
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    return outputs


def test_the_catalog_survives_a_process_restart(tmp_path: Path) -> None:
    url = str(tmp_path / "catalog.db")
    run_all(url, tmp_path, ("write", "first", 2))
    with Catalog(url) as catalog:
        rows = catalog.all_chunk_rows("default")
        assert len(rows) == 6 and len(catalog.entries("default")) == 2
        catalog.replace_document(*document("parent.txt", 1))
    assert run_all(url, tmp_path, ("read", "-", 0)) == [",".join(str(r) for r in rows + [max(rows) + 1])]


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_writer_processes_at_once(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("postgres_url") if backend == "postgres" else str(tmp_path / "catalog.db")
    run_all(url, tmp_path, ("write", "left", 25), ("write", "right", 25))
    with Catalog(url) as catalog:
        assert len(catalog.documents("default")) == 50
        rows = catalog.all_chunk_rows("default")
        assert len(rows) == len(set(rows)) == 150
        assert len(catalog.entries("default")) == 50
        for doc in catalog.documents("default"):
            assert len(catalog.chunks_for_document(doc.doc_id)) == 3


def test_in_memory_catalog() -> None:
    with Catalog(":memory:") as catalog:
        rows = catalog.replace_document(*document("a.txt", 2))
        assert len(catalog.chunks_by_rows(rows, "default")) == 2


class _LockedCursor:
    """A sqlite3 cursor whose first ``failures`` journal-mode switches fail as under a racing opener."""

    def __init__(self, cursor: sqlite3.Cursor, failures: int) -> None:
        self.cursor, self.failures, self.attempts = cursor, failures, 0

    def execute(self, sql: str) -> sqlite3.Cursor:
        if sql == "PRAGMA journal_mode = WAL":
            self.attempts += 1
            if self.attempts <= self.failures:
                raise sqlite3.OperationalError("database is locked")
        return self.cursor.execute(sql)


def test_switching_to_wal_waits_out_a_racing_opener(tmp_path: Path) -> None:
    """SQLite skips the busy handler for this switch; two processes opening a new catalog once failed CI."""
    conn = sqlite3.connect(tmp_path / "c.db")
    cursor = _LockedCursor(conn.cursor(), failures=3)
    _enable_wal(cursor, timeout=5.0)
    assert cursor.attempts == 4
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    _enable_wal(cursor, timeout=5.0)  # already WAL: no switch attempted
    assert cursor.attempts == 4
    conn.close()


def test_switching_to_wal_gives_up_at_the_timeout(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "c.db")
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        _enable_wal(_LockedCursor(conn.cursor(), failures=10**6), timeout=0.05)
    conn.close()


def _count_rows(url: str) -> dict[str, int]:
    """Rows in each ragkv table, read around the Catalog API (which refuses a bad tenant)."""
    engine = create_engine(url if "://" in url else f"sqlite:///{url}")
    with engine.connect() as conn:
        counts = {
            table: int(conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one())
            for table in ("ragkv_documents", "ragkv_chunks", "ragkv_entries")
        }
    engine.dispose()
    return counts


def test_a_tenant_over_256_characters_is_refused_before_any_write(catalog: Catalog, catalog_url: str) -> None:
    """The same limit on every backend: SQLite used to store it, PostgreSQL failed mid-write."""
    long = "t" * 257
    doc, chunks = document("a.txt", 2, tenant=long)
    with pytest.raises(ValueError, match="at most 256"):
        catalog.replace_document(doc, chunks)
    with pytest.raises(ValueError, match="at most 256"):
        catalog.record_entry(
            make_key(1, long), tenant=long, tokens_digest="t", codec="raw", level=0, nbytes=1, num_tokens=1
        )
    for call in (catalog.get_document, catalog.remove_document, catalog.document_chunks):
        with pytest.raises(ValueError, match="at most 256"):
            call("a.txt", long)
    for read in (catalog.all_chunk_rows, catalog.documents, catalog.entries):
        with pytest.raises(ValueError, match="at most 256"):
            read(long)
    with pytest.raises(ValueError, match="at most 256"):
        catalog.chunks_by_rows([1], long)
    assert _count_rows(catalog_url) == {"ragkv_documents": 0, "ragkv_chunks": 0, "ragkv_entries": 0}
    longest = "t" * 256
    catalog.replace_document(*document("a.txt", 2, tenant=longest))
    assert len(catalog.all_chunk_rows(longest)) == 2


def test_document_chunks_are_the_rows_recorded_for_a_source(catalog: Catalog) -> None:
    doc, chunks = document("a.txt", 3)
    rows = catalog.replace_document(doc, chunks)
    catalog.replace_document(*document("b.txt", 2))
    assert catalog.document_chunks("a.txt", "default") == dict(zip(rows, chunks, strict=True))
    assert catalog.document_chunks("a.txt", "bob") == {}
    assert catalog.chunk_map(rows[::-1] + [999_999], "default") == dict(zip(rows, chunks, strict=True))


def test_orphan_chunks_of_a_deleted_document_row_are_removed_on_replace(tmp_path: Path) -> None:
    """A document row deleted by hand (sqlite3 shell: foreign keys off) used to leave its chunks behind."""
    url = str(tmp_path / "catalog.db")
    with Catalog(url) as catalog:
        doc, chunks = document("a.txt", 3)
        old_rows = catalog.replace_document(doc, chunks)
        catalog.replace_document(*document("b.txt", 1))
    raw = sqlite3.connect(url)  # foreign keys are off by default, as in the sqlite3 shell
    raw.execute("DELETE FROM ragkv_documents WHERE source = 'a.txt'")
    raw.commit()
    raw.close()
    with Catalog(url) as catalog:
        assert catalog.get_document("a.txt", "default") is None
        new_rows = catalog.replace_document(doc, chunks)
        assert set(catalog.all_chunk_rows("default")) == set(new_rows) | set(
            catalog.document_chunks("b.txt", "default")
        )
        assert catalog.chunks_by_rows(old_rows, "default") == []
        assert catalog.remove_document("a.txt", "default") == new_rows


def test_remove_document_returns_orphan_rows_too(tmp_path: Path) -> None:
    url = str(tmp_path / "catalog.db")
    with Catalog(url) as catalog:
        rows = catalog.replace_document(*document("a.txt", 2))
    raw = sqlite3.connect(url)
    raw.execute("DELETE FROM ragkv_documents")
    raw.commit()
    raw.close()
    with Catalog(url) as catalog:
        assert catalog.remove_document("a.txt", "default") == rows  # so the caller drops them from FAISS
        assert catalog.all_chunk_rows("default") == []


def test_a_missing_catalog_is_not_created_by_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "new-data-dir" / "catalog.db"
    for url in (str(path), f"sqlite:///{path}"):
        with pytest.raises(CatalogError, match="no catalog at .*ragkv index") as info:
            Catalog(url, create=False)
        assert "\n" not in str(info.value)
    assert not path.parent.exists()


def test_a_missing_directory_is_created_by_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "catalog.db"
    with Catalog(f"sqlite:///{path}") as catalog:
        catalog.replace_document(*document("a.txt", 1))
    with Catalog(str(path), create=False) as catalog:
        assert len(catalog.documents("default")) == 1


def test_a_file_that_is_not_a_database_is_a_one_line_catalog_error(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    path.write_bytes(b"this is not SQLite at all\n" * 200)
    with pytest.raises(CatalogError, match="is not a ragkv catalog") as info:
        Catalog(str(path))
    assert "\n" not in str(info.value) and "sqlalche.me" not in str(info.value)
    with pytest.raises(CatalogError, match="is a directory"):
        Catalog(str(tmp_path))


@pytest.mark.postgres
def test_an_empty_postgres_database_is_not_a_catalog_for_a_reader(postgres_url: str) -> None:
    with pytest.raises(CatalogError, match="no ragkv catalog in .*ragkv index"):
        Catalog(postgres_url, create=False)
    assert "ragkv_documents" not in inspect(create_engine(postgres_url)).get_table_names()


def test_an_old_catalog_gains_the_source_index_on_open(tmp_path: Path) -> None:
    url = str(tmp_path / "catalog.db")
    Catalog(url).close()
    raw = sqlite3.connect(url)
    raw.execute("DROP INDEX ix_ragkv_chunks_tenant_source")
    raw.commit()
    raw.close()
    Catalog(url).close()
    raw = sqlite3.connect(url)
    names = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    raw.close()
    assert "ix_ragkv_chunks_tenant_source" in names
