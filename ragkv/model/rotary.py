"""Re-rotation: move cached keys from the positions they were rotated at to new ones."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RotaryFn", "model_rotary_fn", "move_keys", "rotate_half", "turn_keys", "turn_tables"]

RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x, cos, sin) -> x`` rotated by the tables, in the model's own pairing of dims."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dim's halves: multiplication by ``i`` in RoPE's pairing."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def model_rotary_fn(model: Any) -> RotaryFn | None:
    """The rotation the model's attention applies (its modeling file's ``apply_rotary_pos_emb``).

    Half-split, interleaved (GLM-4, ERNIE 4.5, Helium) and partial layouts are each family's own
    function, so re-rotating through it pairs the dims the way the model did. None when the modeling
    file has no such function (the load-time check then refuses the model if plain half-split
    re-rotation does not reproduce its keys).
    """
    attn = getattr(model.model.layers[0], "self_attn", None)
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        return None

    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # the function rotates (q, k); an empty q keeps it to one pass over the keys
        return fn(x[:0], x, cos, sin)[1]  # type: ignore[no-any-return]

    return apply


def move_keys(
    keys: torch.Tensor,
    cos_p: torch.Tensor,
    sin_p: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    apply: RotaryFn | None = None,
    rotated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keys rotated at p, moved to q: undo (cos_p, sin_p), apply (cos_q, sin_q); fp32 result.

    ``keys``: ``[layers, kv_heads, tokens, head_dim]``; the tables ``[1, tokens, rot_dim]`` (the
    model's own rotary module at each position). Partial rotary rotates the first ``rot_dim``
    dims only; the rest pass. For an attention-scaled variant (cos, sin) = a * (cos t, sin t), so
    undoing divides by cos^2 + sin^2 = a^2. ``apply`` is the model's rotation (default: half-split);
    ``rotated`` ([layers] bool) marks the layers that apply RoPE at all (NoPE layers pass unchanged).
    """
    k = keys.float()
    if rotated is not None and not bool(rotated.all()):
        out = k.clone()
        idx = rotated.nonzero().squeeze(1).to(k.device, non_blocking=True)  # rotated: a host tensor
        out[idx] = move_keys(k[idx], cos_p, sin_p, cos_q, sin_q, apply)
        return out
    return turn_keys(k, *turn_tables(cos_p, sin_p, cos_q, sin_q), apply)


def turn_tables(
    cos_p: torch.Tensor, sin_p: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one rotation ``(cos_d, sin_d)`` ``[1, tokens, rot_dim]`` that moves keys rotated at p to q.

    As complex pairs the key was multiplied by z_p = cos_p + i sin_p; moving it multiplies by
    z_q / z_p = z_q * conj(z_p) / |z_p|^2: one table, then one pass over the keys. The formula is
    elementwise per dim, so it holds in whatever layout the tables pair the dims.
    """
    norm = cos_p * cos_p + sin_p * sin_p
    return (cos_q * cos_p + sin_q * sin_p) / norm, (sin_q * cos_p - cos_q * sin_p) / norm


def turn_keys(k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor, apply: RotaryFn | None = None) -> torch.Tensor:
    """fp32 keys ``k`` ``[..., tokens, head_dim]`` turned by :func:`turn_tables`' rotation (partial rotary:
    the first ``rot_dim`` dims only)."""
    turn = apply or _half_split
    rot = cos_d.shape[-1]
    if rot == k.shape[-1]:
        return turn(k, cos_d, sin_d)
    return torch.cat([turn(k[..., :rot], cos_d, sin_d), k[..., rot:]], dim=-1)
