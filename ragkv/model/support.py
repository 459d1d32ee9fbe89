"""The load-time check: run the model and see that its chunk caches can be moved exactly.

ragkv decides support from what a model does, not from a list of names. A short random sequence
is run at positions 0.. and again at ``shift``..; in a decoder whose attention depends on relative
positions only, the two runs have the same hidden states, so at every layer the keys computed at
``shift`` must equal the keys computed at 0 re-rotated by the model's own rotary function (a layer
applying RoPE) or the unchanged keys (a layer without RoPE, e.g. SmolLM3's NoPE layers), and the
values must not change. Anything else (interleaved pairs rotated half-split, absolute positions,
a cache that is not per-head K/V as in MLA) is refused with :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache

from ragkv.errors import UnsupportedModelError
from ragkv.model.rotary import move_keys

if TYPE_CHECKING:
    from ragkv.model.adapter import ModelAdapter

logger = logging.getLogger(__name__)

__all__ = ["rotated_layers"]

_TOKENS = 8  # probe length
_SHIFT = 61  # far enough that every frequency turns visibly (61 rad at the highest)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative error two runs of one sequence at shifted positions may show in ``dtype``."""
    return 2e-3 if dtype == torch.float32 else 6e-2


def _layer_kv(adapter: ModelAdapter, ids: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``[kv_heads, T, D]`` of ``ids`` run at positions ``start..``."""
    cache = DynamicCache(config=adapter.model.config)
    try:
        adapter.forward(ids, cache, start, logits="none")
    except (RuntimeError, ValueError, IndexError) as e:  # a layout the adapter misread fails here, at load
        raise UnsupportedModelError(
            f"model_type={adapter.spec.model_type!r} fails on a probe sequence through ragkv's adapter ({e}); "
            "its layout is not the Llama-like decoder ragkv supports"
        ) from e
    out = []
    want = (1, adapter.spec.num_kv_heads, ids.numel(), adapter.spec.head_dim)
    for i, layer in enumerate(cache.layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (k, v)]
        if shapes[0] != want or shapes[1] != want:
            mla = getattr(adapter.model.config, "kv_lora_rank", None)
            raise UnsupportedModelError(
                f"model_type={adapter.spec.model_type!r} layer {i} caches keys {shapes[0]} and values {shapes[1]}, "
                f"not per-head K/V {want}"
                + (f" (multi-head latent attention, kv_lora_rank={mla})" if mla else "")
                + "; ragkv stores and moves per-head K/V caches only"
            )
        assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)  # checked by the shapes
        out.append((k[0].float(), v[0].float()))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def rotated_layers(adapter: ModelAdapter, apply: Any) -> torch.Tensor:
    """Run the probe; return which layers apply RoPE (``[layers]`` bool) or raise UnsupportedModelError."""
    shift = min(_SHIFT, adapter.spec.max_context - _TOKENS)
    ids = torch.randint(0, adapter.spec.vocab_size, (_TOKENS,), generator=torch.Generator().manual_seed(0))
    at0, moved_to = _layer_kv(adapter, ids, 0), _layer_kv(adapter, ids, shift)
    cos_p, sin_p = adapter.rotary(torch.arange(_TOKENS))
    cos_q, sin_q = adapter.rotary(torch.arange(shift, shift + _TOKENS))
    tol = _tolerance(adapter.dtype)
    flags = []
    for i, ((k0, v0), (ks, vs)) in enumerate(zip(at0, moved_to, strict=True)):
        moved = move_keys(k0.unsqueeze(0), cos_p, sin_p, cos_q, sin_q, apply)[0]
        err_rot, err_same, err_v = _rel(moved, ks), _rel(k0, ks), _rel(v0, vs)
        if err_v > tol or min(err_rot, err_same) > tol:
            raise UnsupportedModelError(
                f"model_type={adapter.spec.model_type!r} layer {i}: a sequence run {shift} positions later "
                f"does not give the cached keys re-rotated by the model's own rotary function (relative "
                f"error {err_rot:.2g}; unrotated {err_same:.2g}; values {err_v:.2g}, tolerance {tol:.0e}); "
                "its chunk caches cannot be moved exactly (absolute positions, or a rotation ragkv "
                "cannot reproduce)"
            )
        flags.append(err_rot <= err_same)
    rotated = torch.tensor(flags, dtype=torch.bool)
    if not rotated.all():
        logger.info(
            "%s: layers %s apply no RoPE; their keys are not re-rotated",
            adapter.name,
            (~rotated).nonzero().flatten().tolist(),
        )
    return rotated
