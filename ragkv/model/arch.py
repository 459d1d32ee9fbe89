"""What ragkv needs to know about a decoder, read from its config: per-architecture differences as data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ragkv.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["ArchSpec", "TESTED_MODEL_TYPES"]

# Decoder families verified by tests (tiny random configs) and by the default model.
TESTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Config fields of families that scale embeddings or logits in the model's forward, outside the
# decoder layers (Cohere, Granite, Gemma 2): fusion's own embed -> layers -> head path would miss them.
_OUTSIDE_LAYER_SCALES = ("logit_scale", "logits_scaling", "embedding_multiplier", "final_logit_softcapping")


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """What ragkv needs to know about a decoder, read from ``model.config`` and its modules."""

    model_type: str  # config.model_type
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head dimension
    hidden_size: int  # residual width
    vocab_size: int
    max_context: int  # config.max_position_embeddings
    rope_type: str  # "default", "llama3", "yarn", ...: the rotary module's variant

    @classmethod
    def from_model(cls, model: Any) -> ArchSpec:
        """Read the spec of a transformers causal LM; raise UnsupportedModelError naming what is missing."""
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no .config; pass a transformers causal LM")
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        _check_layout(model, cfg)
        _check_attention_layers(cfg)
        _check_no_outside_scaling(cfg)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if cfg.model_type not in TESTED_MODEL_TYPES:
            logger.warning("model_type=%r is untested with ragkv; Llama-like layout found, going on", cfg.model_type)
        return cls(
            model_type=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(cfg.vocab_size),
            max_context=int(getattr(cfg, "max_position_embeddings", 2048)),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
        )


def _check_layout(model: Any, cfg: Any) -> None:
    """The config fields and modules of a Llama-like decoder (embed, layers, rotary, norm, head)."""
    missing = [
        name
        for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
        if getattr(cfg, name, None) is None
    ]
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "rotary_emb", "norm"):
        if inner is None or not hasattr(inner, attr):
            missing.append(f"model.model.{attr}")
    if not hasattr(model, "lm_head"):
        missing.append("model.lm_head")
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={getattr(cfg, 'model_type', '?')!r}) is not a Llama-like "
            f"decoder ragkv supports: missing {', '.join(missing)}"
        )


def _check_attention_layers(cfg: Any) -> None:
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} has non-full attention layers {sorted(set(layer_types))}: "
            "chunk caches need every layer to keep all keys (sliding-window and linear attention are unsupported)"
        )


def _check_no_outside_scaling(cfg: Any) -> None:
    scaled = [
        f"{name}={getattr(cfg, name)!r}"
        for name in _OUTSIDE_LAYER_SCALES
        if getattr(cfg, name, None) not in (None, 1, 1.0)
    ]
    if scaled or str(cfg.model_type).startswith("gemma"):
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} scales embeddings or logits outside its decoder layers "
            f"({', '.join(scaled) or 'embedding normalizer'}); ragkv runs the embedding, the layers and "
            "the head itself during fusion, so it supports plain Llama-like decoders only"
        )
