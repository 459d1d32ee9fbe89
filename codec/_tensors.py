"""Tensor <-> bytes helpers shared by the codecs (private)."""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from ragkv.errors import CodecError

# Payloads are little-endian; the helpers below reinterpret memory directly.
if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("ragkv.codec supports little-endian machines only")

def to_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of ``t`` (row-major)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def from_section(
    section: memoryview | bytes,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    device: torch.device | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A new tensor holding ``section`` reinterpreted as ``dtype`` of ``shape``.

    The result never aliases ``section`` (stored bytes are immutable and may be reused).

    Raises:
        CodecError: the section's length does not match ``shape``.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(section) != expected:
        raise CodecError(f"payload section holds {len(section)} bytes; {expected} expected")
    out_dtype = out_dtype or dtype
    device = device or torch.device("cpu")
    if expected == 0:
        return torch.empty(shape, dtype=out_dtype, device=device)
    if isinstance(section, memoryview) and _address(section) % itemsize:
        section = bytes(section)  # misaligned: copy to a fresh (aligned) buffer
    with warnings.catch_warnings():
        # frombuffer warns that the buffer is read-only; we copy below before anyone can write.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(section, dtype=dtype).view(shape)
    if out_dtype == dtype and device.type == "cpu":
        return t.clone()
    return t.to(device=device, dtype=out_dtype)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0
