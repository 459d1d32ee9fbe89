"""The model adapter room: the one place that touches transformers internals (spec, caches, rotary, attention)."""

from ragkv.model.adapter import ModelAdapter, load_model
from ragkv.model.arch import ArchSpec
from ragkv.model.attention import AttentionProbe, Steer
from ragkv.model.caches import ScatterCache, cache_to_kv, concat_kv, crop_cache, dynamic_cache

__all__ = [
    "ArchSpec",
    "AttentionProbe",
    "ModelAdapter",
    "ScatterCache",
    "Steer",
    "cache_to_kv",
    "concat_kv",
    "crop_cache",
    "dynamic_cache",
    "load_model",
]
