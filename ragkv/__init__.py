"""ragkv: precomputed, compressed, shared KV caches for retrieval-augmented generation.

The public API, importable from the root::

    from ragkv import RagKV, EngineConfig

    with RagKV(EngineConfig(data_dir="rag-data")) as rag:
        rag.index(["docs/"])
        print(rag.answer("What does heappush do?").text)

Records and errors are imported with the package; everything that needs torch (the engine, the
configs of fusion and generation, the model loader) is imported on first use, so ``import ragkv``
stays cheap for the CLI's checks and for tools that only read records.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ragkv.errors import (
    CatalogError,
    CodecError,
    ContextTooLongError,
    DocumentNotFoundError,
    IncompatibleCacheError,
    RagkvError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from ragkv.types import (
    CachedText,
    Chunk,
    ChunkKey,
    ChunkKV,
    CodecSpec,
    EncodedChunk,
    GenerationResult,
    GenerationStats,
)

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from ragkv.engine import AnswerStream, EngineConfig, RagKV, RemoveReport
    from ragkv.fusion import FusionConfig
    from ragkv.generation import GenerationConfig
    from ragkv.model import ModelAdapter, load_model
    from ragkv.planner.config import LoadConfig
    from ragkv.retriever.documents import Document, load_documents
    from ragkv.retriever.kv_retriever import IndexReport, RetrieverConfig

__version__ = "0.1.0"

# name -> module that defines it; imported by __getattr__ on first access (PEP 562)
_LAZY: dict[str, str] = {
    "AnswerStream": "ragkv.engine",
    "EngineConfig": "ragkv.engine",
    "RagKV": "ragkv.engine",
    "RemoveReport": "ragkv.engine",
    "FusionConfig": "ragkv.fusion",
    "GenerationConfig": "ragkv.generation",
    "LoadConfig": "ragkv.planner.config",
    "ModelAdapter": "ragkv.model",
    "load_model": "ragkv.model",
    "Document": "ragkv.retriever.documents",
    "load_documents": "ragkv.retriever.documents",
    "IndexReport": "ragkv.retriever.kv_retriever",
    "RetrieverConfig": "ragkv.retriever.kv_retriever",
}

__all__ = [
    "AnswerStream",
    "CachedText",
    "CatalogError",
    "Chunk",
    "ChunkKV",
    "ChunkKey",
    "CodecError",
    "CodecSpec",
    "ContextTooLongError",
    "Document",
    "DocumentNotFoundError",
    "EncodedChunk",
    "EngineConfig",
    "FusionConfig",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "IncompatibleCacheError",
    "IndexReport",
    "LoadConfig",
    "ModelAdapter",
    "RagKV",
    "RagkvError",
    "RemoveReport",
    "RetrieverConfig",
    "StoreUnavailableError",
    "UnsupportedModelError",
    "__version__",
    "load_documents",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # AttributeError lets `from ragkv import codec` fall back to the submodule
        raise AttributeError(f"module 'ragkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
