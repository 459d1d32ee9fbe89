"""FaissIndex: add/search/remove, persistence, atomic saves, and embedder mismatch detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ragkv.digests import text_digest
from ragkv.errors import RagkvError
from ragkv.retriever import index as index_mod
from ragkv.retriever.index import META_SUFFIX, FaissIndex, digest_to_id

DIM = 8


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def vectors() -> np.ndarray:
    return unit(np.random.default_rng(0).normal(size=(20, DIM)))


@pytest.fixture
def filled(vectors: np.ndarray) -> FaissIndex:
    index = FaissIndex(DIM)
    index.add(list(range(100, 120)), vectors)
    return index


def brute_force(vectors: np.ndarray, ids: list[int], query: np.ndarray, k: int) -> list[int]:
    order = np.argsort(-(vectors @ query), kind="stable")[:k]
    return [ids[i] for i in order]


def test_search_matches_brute_force(filled: FaissIndex, vectors: np.ndarray):
    ids = list(range(100, 120))
    for row in range(5):
        hits = filled.search(vectors[row], k=5)
        assert [i for i, _ in hits] == brute_force(vectors, ids, vectors[row], 5)
        assert hits[0] == (100 + row, pytest.approx(1.0, abs=1e-5))
        scores = [s for _, s in hits]
        assert scores == sorted(scores, reverse=True)


def test_batch_search_and_k_larger_than_index(filled: FaissIndex, vectors: np.ndarray):
    batch = filled.search(vectors[:3], k=50)
    assert len(batch) == 3 and all(len(hits) == 20 for hits in batch)
    assert [hits[0][0] for hits in batch] == [100, 101, 102]
    assert FaissIndex(DIM).search(vectors[0], k=3) == []
    assert FaissIndex(DIM).search(vectors[:2], k=3) == [[], []]


def test_remove(filled: FaissIndex, vectors: np.ndarray):
    assert filled.remove([100, 101, 999]) == 2
    assert len(filled) == 18 and 100 not in filled and 102 in filled
    assert all(i not in (100, 101) for i, _ in filled.search(vectors[0], k=20))
    assert filled.remove([]) == 0
    filled.add([100], vectors[:1])  # a removed id can be added again
    assert filled.search(vectors[0], k=1)[0][0] == 100


def test_add_validation(filled: FaissIndex, vectors: np.ndarray):
    with pytest.raises(ValueError, match="already in the index"):
        filled.add([100], vectors[:1])
    with pytest.raises(ValueError, match="unique"):
        filled.add([1, 1], vectors[:2])
    with pytest.raises(ValueError, match=r"vectors must be \[len\(ids\)=2, dim=8\]"):
        filled.add([1, 2], vectors[:3])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        filled.add([-5], vectors[:1])
    with pytest.raises(ValueError, match="NaN"):
        filled.add([1], np.full((1, DIM), np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="dim=8"):
        filled.search(np.ones(DIM + 1, dtype=np.float32), k=1)
    with pytest.raises(ValueError, match="k must be"):
        filled.search(vectors[0], k=0)
    assert len(filled) == 20


def test_ids_and_reconstruct(filled: FaissIndex, vectors: np.ndarray):
    assert filled.ids() == list(range(100, 120))
    np.testing.assert_allclose(filled.reconstruct(105), vectors[5])
    with pytest.raises(KeyError):
        filled.reconstruct(5)


def test_save_load_round_trip(tmp_path: Path, vectors: np.ndarray):
    path = tmp_path / "sub" / "index.faiss"
    index = FaissIndex(DIM, path, fingerprint="emb-a")
    index.add([digest_to_id(text_digest(str(i))) for i in range(20)], vectors)
    index.remove([digest_to_id(text_digest("3"))])
    index.save()
    meta = json.loads((tmp_path / "sub" / f"index.faiss{META_SUFFIX}").read_text())
    assert meta["dim"] == DIM and meta["fingerprint"] == "emb-a"

    loaded = FaissIndex.load(path, DIM, fingerprint="emb-a")
    assert len(loaded) == 19 and loaded.ids() == index.ids()
    assert loaded.search(vectors[:4], k=4) == index.search(vectors[:4], k=4)
    # The loaded index keeps working: add, remove, save again.
    loaded.add([7], vectors[3:4])
    loaded.save()
    assert len(FaissIndex.load(path, DIM)) == 20


def test_open_creates_then_loads(tmp_path: Path, vectors: np.ndarray):
    path = tmp_path / "idx.faiss"
    index = FaissIndex.open(path, DIM, fingerprint="emb-a")
    assert len(index) == 0 and not path.exists()  # nothing is written until save()
    index.add([1, 2], vectors[:2])
    index.save()
    again = FaissIndex.open(path, DIM, fingerprint="emb-a")
    assert again.ids() == [1, 2] and again.fingerprint == "emb-a"


def test_dim_mismatch_says_how_to_rebuild(tmp_path: Path, vectors: np.ndarray):
    path = tmp_path / "idx.faiss"
    index = FaissIndex(DIM, path, fingerprint="emb-a")
    index.add([1], vectors[:1])
    index.save()
    with pytest.raises(ValueError, match=r"built with another embedder \(dim 8, this one has dim 384\)") as info:
        FaissIndex.open(path, 384)
    assert "delete" in str(info.value) and "new data directory" in str(info.value)
    # Without the sidecar, the dimension stored in the FAISS file itself is still checked.
    (tmp_path / f"idx.faiss{META_SUFFIX}").unlink()
    with pytest.raises(ValueError, match="another embedder"):
        FaissIndex.load(path, 384)


def test_fingerprint_mismatch(tmp_path: Path, vectors: np.ndarray):
    path = tmp_path / "idx.faiss"
    index = FaissIndex(DIM, path, fingerprint="emb-a")
    index.add([1], vectors[:1])
    index.save()
    with pytest.raises(ValueError, match="fingerprint 'emb-a', this one is 'emb-b'"):
        FaissIndex.open(path, DIM, fingerprint="emb-b")
    assert len(FaissIndex.load(path, DIM)) == 1  # no fingerprint given: not checked


def test_missing_sidecar_is_tolerated(tmp_path: Path, vectors: np.ndarray, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "idx.faiss"
    index = FaissIndex(DIM, path)
    index.add([1], vectors[:1])
    index.save()
    (tmp_path / f"idx.faiss{META_SUFFIX}").unlink()
    assert len(FaissIndex.load(path, DIM, fingerprint="x")) == 1
    assert "no sidecar" in caplog.text


def test_failed_save_leaves_old_index_and_no_temp_file(
    tmp_path: Path, vectors: np.ndarray, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "idx.faiss"
    index = FaissIndex(DIM, path, fingerprint="emb-a")
    index.add([1, 2], vectors[:2])
    index.save()
    before = path.read_bytes()
    index.add([3], vectors[2:3])

    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == path:
            raise OSError("disk full (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(index_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        index.save()
    assert path.read_bytes() == before
    # no temp file left (the lock file, which writers share, stays)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx.faiss", "idx.faiss.lock", f"idx.faiss{META_SUFFIX}"]
    assert FaissIndex.load(path, DIM).ids() == [1, 2]


def test_corrupt_index_file(tmp_path: Path):
    path = tmp_path / "idx.faiss"
    path.write_bytes(b"not a faiss index")
    with pytest.raises(RagkvError, match="not a readable FAISS index"):
        FaissIndex.load(path, DIM)


def test_load_missing_and_save_without_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="FaissIndex.open"):
        FaissIndex.load(tmp_path / "absent.faiss", DIM)
    with pytest.raises(ValueError, match="has no path"):
        FaissIndex(DIM).save()
    with pytest.raises(ValueError, match="positive int"):
        FaissIndex(0)


def test_digest_to_id_is_a_valid_id():
    ids = [digest_to_id(text_digest(str(i))) for i in range(1000)]
    assert len(set(ids)) == 1000 and all(0 <= i < 2**60 for i in ids)
