"""``ragkv`` under faults (issue 33): a refused cache, a full disk and a tier that cannot delete are each
a one-line error and a non-zero exit, with nothing committed that is not whole."""

from __future__ import annotations

import errno

from ragkv.errors import StoreUnavailableError
from tests.core import test_cli
from tests.core.test_cli import one_line_error, run

corpus, tiny_model_dir = test_cli.corpus, test_cli.tiny_model_dir  # the same fixtures


def test_index_into_a_disk_tier_that_refuses_the_caches_exits_1_and_commits_nothing(
    monkeypatch, capsys, tmp_path, corpus, tiny_model_dir
):
    data = tmp_path / "d"
    store = f"memory://,disk://{data / 'kv'}?tenant_max_bytes=1KiB"
    code, out, err = run(monkeypatch, capsys, "index", str(corpus), "--data-dir", str(data),
                         "--model", str(tiny_model_dir), "--store", store)  # fmt: skip
    assert code == 1 and "0.0 MB stored" in out and "could not be stored" in err
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", f"disk://{data / 'kv'}")
    assert code == 0 and "0 documents" in out


def test_a_full_disk_at_the_faiss_save_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path, corpus, tiny_model_dir):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ragkv.retriever.index._atomic_write", full)
    data = tmp_path / "d"
    code, _, err = run(monkeypatch, capsys, "index", str(corpus), "--data-dir", str(data),
                       "--model", str(tiny_model_dir), "--store", str(data / "kv"))  # fmt: skip
    assert code == 1
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "No space left on device" in line[0] and "not committed" in line[0]
    assert "Traceback" not in err
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", str(data / "kv"))
    assert code == 0 and "0 documents" in out


def test_remove_with_a_tier_that_cannot_delete_exits_1_and_a_retry_finishes(
    monkeypatch, capsys, tmp_path, corpus, tiny_model_dir
):
    data = tmp_path / "d"
    base = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--store", str(data / "kv")]
    assert run(monkeypatch, capsys, "index", str(corpus), *base)[0] == 0
    source = str(corpus / "apples.txt")

    def read_only(self, key):
        raise StoreUnavailableError("read-only file system")

    with monkeypatch.context() as patch:
        patch.setattr("ragkv.cache.disk.DiskTier._delete", read_only)
        code, out, err = run(monkeypatch, capsys, "remove", source, *base)
    assert code == 1 and "pending" in err and "ragkv remove" in err
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", str(data / "kv"))
    assert "0 documents" in out and "pending" in out
    code, out, _ = run(monkeypatch, capsys, "remove", source, *base)  # the retry finds the pending entries
    assert code == 0 and "removed" in out
    code, out, _ = run(monkeypatch, capsys, "stats", "--data-dir", str(data), "--store", str(data / "kv"))
    assert "0 cache entries" in out and "pending" not in out
    code, _, err = run(monkeypatch, capsys, "remove", source, *base)
    assert code == 2 and "no document" in one_line_error(code, err)


def test_check_reports_a_lost_faiss_file_and_the_repair_leaves_nothing(
    monkeypatch, capsys, tmp_path, corpus, tiny_model_dir
):
    data = tmp_path / "d"
    base = ["--data-dir", str(data), "--model", str(tiny_model_dir), "--store", str(data / "kv")]
    assert run(monkeypatch, capsys, "index", str(corpus), *base)[0] == 0
    assert run(monkeypatch, capsys, "check", *base)[0] == 0
    for faiss_file in data.glob("chunks-*.faiss"):
        faiss_file.unlink()  # lost: the catalog's rows have no vectors
    code, out, _ = run(monkeypatch, capsys, "check", *base)
    assert code == 1 and "1 documents" in out and "rows without a vector" in out and "0 rows" not in out
    code, out, _ = run(monkeypatch, capsys, "check", "--repair", *base)
    assert code == 0, out
    code, out, _ = run(monkeypatch, capsys, "check", *base)
    assert code == 0 and "0 rows without a vector, 0 vectors without a row" in out
