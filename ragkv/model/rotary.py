"""Re-rotation: move cached keys from the positions they were rotated at to new ones."""

from __future__ import annotations

import torch

__all__ = ["move_keys", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dim's halves: multiplication by ``i`` in RoPE's pairing."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def move_keys(
    keys: torch.Tensor, cos_p: torch.Tensor, sin_p: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor
) -> torch.Tensor:
    """Keys rotated at p, moved to q: undo (cos_p, sin_p), apply (cos_q, sin_q); fp32 result.

    ``keys``: ``[layers, kv_heads, tokens, head_dim]``; the tables ``[1, tokens, rot_dim]`` (the
    model's own rotary module at each position). Partial rotary rotates the first ``rot_dim``
    dims only; the rest pass. For an attention-scaled variant (cos, sin) = a * (cos t, sin t), so
    undoing divides by cos^2 + sin^2 = a^2.
    """
    rot = cos_p.shape[-1]
    # As complex pairs the key was multiplied by z_p = cos_p + i sin_p; moving it multiplies by
    # z_q / z_p = z_q * conj(z_p) / |z_p|^2: one [T, R] table, then one pass over the keys.
    norm = cos_p * cos_p + sin_p * sin_p
    cos_d = (cos_q * cos_p + sin_q * sin_p) / norm
    sin_d = (sin_q * cos_p - cos_q * sin_p) / norm
    k = keys.float()
    if rot == k.shape[-1]:
        return k * cos_d + rotate_half(k) * sin_d
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    return torch.cat([k_rot * cos_d + rotate_half(k_rot) * sin_d, k_pass], dim=-1)
