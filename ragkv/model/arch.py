"""What ragkv needs to know about a decoder, read from its config: per-architecture differences as data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ragkv.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["ArchSpec", "check_config"]

# RoPE variants whose frequencies depend on how far the sequence reaches: past the original context
# transformers switches the whole sequence to other frequencies (LongRoPE's long factors, dynamic
# NTK's larger base), so caches computed earlier no longer match. Below it they are plain RoPE.
_POSITION_DEPENDENT_ROPE = ("longrope", "dynamic")

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
        check_config(cfg)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        return cls(
            model_type=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(cfg.vocab_size),
            max_context=_exact_context(cfg, rope, rope_type),
            rope_type=rope_type,
        )


def check_config(config: Any) -> None:
    """Refuse from a config alone (config.json, before any weight is read) what ArchSpec would refuse.

    Raises:
        UnsupportedModelError: attention layers without per-token K/V, scaling outside the decoder
            layers, or multi-head latent attention.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _check_attention_layers(cfg)
    _check_no_outside_scaling(cfg)
    _check_per_head_cache(cfg)


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
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} has attention layers of type {other}: chunk caches need every "
            "layer to keep per-token keys and values (full or sliding-window attention)"
        )


def _check_per_head_cache(cfg: Any) -> None:
    rank = getattr(cfg, "kv_lora_rank", None)
    if rank:
        raise UnsupportedModelError(
            f"model_type={cfg.model_type!r} uses multi-head latent attention (kv_lora_rank={rank}): its keys "
            "split into a rotated and an unrotated part of other widths than its values, not the per-head "
            "K/V caches ragkv stores and moves"
        )


def _sliding_window(cfg: Any) -> int | None:
    """The window of the model's sliding-window layers (per-layer types or one config-level window)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2's switch
        return None
    return int(window)


def _exact_context(cfg: Any, rope: dict[str, Any], rope_type: str) -> int:
    """The longest prompt (plus answer) the model computes exactly like full attention with plain RoPE.

    A sliding window of W lets a query see keys less than W positions back, and transformers' cache
    keeps only the last W - 1 of them: up to W - 1 tokens the window never bites, past it a chunk's
    cache would hold keys the model drops. LongRoPE and dynamic NTK switch every position's
    frequencies once the sequence passes the original context. Prompts past the limit raise
    ContextTooLongError (``ModelAdapter.check_context``) instead of giving caches that differ from
    the model's own prefill.
    """
    limit = int(getattr(cfg, "max_position_embeddings", 2048))
    window = _sliding_window(cfg)
    if window is not None and window - 1 < limit:
        logger.info(
            "model_type=%r: sliding window %d, prompts limited to %d tokens", cfg.model_type, window, window - 1
        )
        limit = window - 1
    if rope_type in _POSITION_DEPENDENT_ROPE:
        original = rope.get("original_max_position_embeddings") or getattr(
            cfg, "original_max_position_embeddings", None
        )
        if rope_type == "dynamic" and not original:
            original = limit  # dynamic NTK keeps the base frequencies up to max_position_embeddings
        if original and int(original) < limit:
            logger.info("model_type=%r: %s RoPE, prompts limited to %d tokens", cfg.model_type, rope_type, original)
            limit = int(original)
    return limit


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
