"""Packing helpers shared by the quantizing codecs (private)."""

from __future__ import annotations

import numpy as np
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


def unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`pack_nibbles` (in numpy, for the decoder): ``count`` uint8 values, flat.

    >>> unpack_nibbles(np.array([33, 15], dtype=np.uint8), 3).tolist()
    [1, 2, 15]
    """
    out = np.empty(2 * packed.size, dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[0::2])
    np.right_shift(packed, 4, out=out[1::2])
    return out[:count]
