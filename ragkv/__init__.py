"""ragkv: precomputed, compressed, shared KV caches for retrieval-augmented generation."""

from ragkv.errors import (
    CodecError,
    IncompatibleCacheError,
    RagkvError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from ragkv.types import Chunk, ChunkKey, ChunkKV, EncodedChunk, GenerationResult, GenerationStats

__version__ = "0.1.0"

__all__ = [
    "Chunk",
    "ChunkKV",
    "ChunkKey",
    "CodecError",
    "EncodedChunk",
    "GenerationResult",
    "GenerationStats",
    "IncompatibleCacheError",
    "RagkvError",
    "StoreUnavailableError",
    "UnsupportedModelError",
    "__version__",
]
