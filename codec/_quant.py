"""Packing helpers shared by the quantizing codecs (private; numpy, single-threaded: small torch
ops on a busy 2-core machine stalled on OpenMP barriers, 10-100x slower)."""

from __future__ import annotations

import numpy as np


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Pack values in ``[0, 15]`` two per byte, first value in the low nibble.

    >>> pack_nibbles(np.array([1, 2, 15], dtype=np.uint8)).tolist()
    [33, 15]
    """
    flat = q.reshape(-1).astype(np.uint8, copy=False)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
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
