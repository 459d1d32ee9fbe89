"""Packing helpers shared by the quantizing codecs (private)."""

from __future__ import annotations

import torch


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack values in ``[0, 15]`` two per byte, first value in the low nibble.

    >>> pack_nibbles(torch.tensor([1, 2, 15], dtype=torch.uint8)).tolist()
    [33, 15]
    """
    flat = q.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``count`` values as uint8, flat.

    >>> unpack_nibbles(torch.tensor([33, 15], dtype=torch.uint8), 3).tolist()
    [1, 2, 15]
    """
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)
    return out[:count]
