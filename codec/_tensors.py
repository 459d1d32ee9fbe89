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
    if device.type == "cpu":
        return t.clone() if out_dtype == dtype else t.to(out_dtype)
    # converted on the device (the same rounding as on the host): the copy moves the narrow dtype
    return upload(t, device).to(out_dtype)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def section_array(section: memoryview | bytes, dtype: str, count: int, offset: int = 0) -> np.ndarray:
    """``count`` little-endian ``dtype`` items of ``section`` as a read-only numpy view.

    Raises:
        CodecError: the section holds a different number of bytes.
    """
    itemsize = np.dtype(dtype).itemsize
    if len(section) != offset + count * itemsize:
        raise CodecError(f"payload section holds {len(section)} bytes; {offset + count * itemsize} expected")
    return np.frombuffer(section, dtype=dtype, count=count, offset=offset)


def dequantize(
    q: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``q * scale + offset`` (broadcasting) as a new tensor on ``device``, computed in fp32, then cast.

    On CPU numpy computes it: measured 10x faster than torch's int8-to-float multiply on this
    2-core machine. Elsewhere the small integer tensor and the scales move to the device and torch
    computes it there, in fp32 like numpy, so a device decode equals the CPU decode moved there
    (multiplying in bf16 would round the scale and the product once more).
    """
    if device.type == "cpu":
        out = np.empty(np.broadcast_shapes(q.shape, scale.shape), dtype=np.float32)
        np.multiply(q, scale, out=out)
        if offset is not None:
            np.add(out, offset, out=out)
        t = torch.from_numpy(out)
        return t if dtype == torch.float32 else t.to(dtype)
    return dequantize_on(
        to_device(q, device), to_device(scale, device), None if offset is None else to_device(offset, device), dtype
    )


def dequantize_on(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The device half of :func:`dequantize`: ``q * scale (+ offset)`` in fp32 (``scale`` is fp32), cast to ``dtype``.

    Runs wherever its inputs are (tests run it on the CPU against the numpy path).
    """
    t = torch.mul(q, scale)  # int * fp32 -> fp32, as numpy promotes
    if offset is not None:
        t.add_(offset)
    return t if dtype == torch.float32 else t.to(dtype)


def staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor the decoder fills before :func:`upload`: pinned when ``device`` is CUDA.

    Pinned memory lets the copy to the GPU run asynchronously (no stream sync per chunk), and the
    entropy stage writes its integers straight into it (no extra host copy).
    """
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``; to CUDA through pinned memory and a non-blocking copy.

    A plain ``.to("cuda")`` from pageable memory synchronizes the stream after the copy. The
    caching host allocator keeps a pinned block alive until its copy has run, so the host tensor
    may be dropped at once.
    """
    if device.type != "cuda":
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Numpy array ``a`` as a new tensor on ``device`` (see :func:`upload`)."""
    if device.type != "cuda":
        return _tensor(a).to(device)
    host = staging(a.shape, torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype, device)
    host.numpy()[...] = a
    return upload(host, device)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor of ``a``, copied when ``a`` is a read-only view (torch needs writable memory)."""
    return torch.from_numpy(np.require(a, requirements=["C", "W"]))
