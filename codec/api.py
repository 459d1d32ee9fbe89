"""``encode`` / ``decode``: ChunkKV <-> one self-describing, checksummed bitstream."""

from __future__ import annotations

import struct

import torch
import zstandard

from ragkv.codec.bitstream import FORMAT_VERSION, pack, unpack
from ragkv.codec.header import BitstreamHeader, position_runs
from ragkv.codec.registry import get_codec
from ragkv.errors import CodecError, IncompatibleCacheError
from ragkv.types import ChunkKV, EncodedChunk

__all__ = ["encode", "decode"]

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
# Failures of foreign code on bytes that passed the checksum but were crafted to mislead: they
# become CodecError here, so callers only ever see ragkv's errors.
_FOREIGN_ERRORS = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    OverflowError,
    RuntimeError,
    struct.error,
    zstandard.ZstdError,
)


def encode(kv: ChunkKV, codec: str = "raw", level: int = 0) -> EncodedChunk:
    """Encode a chunk's KV into one bitstream.

    Args:
        kv: the chunk's KV, on any device, float16/bfloat16/float32/float64.
        codec: a registered codec name (see :func:`available_codecs`).
        level: one of the codec's levels; lower is more faithful.

    Returns:
        The bitstream with its codec, level and token count.

    Raises:
        ValueError: unknown codec or level, an unsupported dtype, or non-finite values.
    """
    impl = get_codec(codec)
    if level not in impl.levels:
        raise ValueError(f"codec {codec!r} has levels {impl.levels}; got {level!r}")
    source_dtype = _DTYPE_NAMES.get(kv.keys.dtype)
    if source_dtype is None or kv.values.dtype != kv.keys.dtype:
        raise ValueError(
            f"KV must be float16, bfloat16, float32 or float64 (keys and values alike); got "
            f"{kv.keys.dtype} and {kv.values.dtype}"
        )
    keys = kv.keys.detach().to("cpu").contiguous()
    values = kv.values.detach().to("cpu").contiguous()
    if not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
        raise ValueError("KV holds NaN or infinite values; refusing to encode a broken cache")
    payload = impl.encode(keys, values, level)
    header = BitstreamHeader(
        format_version=FORMAT_VERSION,
        codec=codec,
        level=level,
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        num_tokens=kv.num_tokens,
        head_dim=kv.head_dim,
        source_dtype=source_dtype,
        model_fingerprint=kv.model_fingerprint,
        position_runs=position_runs(kv.positions.tolist()),
        section_sizes=tuple(len(s) for s in payload.sections),
        params=payload.params,
    )
    return EncodedChunk(codec=codec, level=level, num_tokens=kv.num_tokens, data=pack(header, payload.sections))


def decode(
    data: bytes | bytearray | memoryview,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    expect_model_fingerprint: str | None = None,
) -> ChunkKV:
    """Decode a bitstream written by :func:`encode`.

    Entropy decoding runs on the CPU; dequantization runs on ``device``.

    Args:
        data: the whole bitstream.
        device: where the returned tensors go.
        dtype: floating dtype of the returned keys and values.
        expect_model_fingerprint: when given, the bitstream must have been made by this model.

    Returns:
        The chunk's KV: keys/values ``[layers, kv_heads, tokens, head_dim]``, positions on ``device``.

    Raises:
        IncompatibleCacheError: another model made it, or a newer ragkv wrote it.
        CodecError: the bytes are truncated, corrupted, foreign, or use an unknown codec.
        TypeError: ``dtype`` is not a floating dtype.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")
    target = torch.device(device)
    header, sections = unpack(data)
    if expect_model_fingerprint is not None and header.model_fingerprint != expect_model_fingerprint:
        raise IncompatibleCacheError(
            f"cached KV was computed by model {header.model_fingerprint!r}, not by "
            f"{expect_model_fingerprint!r}; recompute it for this model"
        )
    try:
        impl = get_codec(header.codec)
    except ValueError as e:
        raise CodecError(f"bitstream uses codec {header.codec!r}, unknown to this ragkv: {e}") from e
    if header.level not in impl.levels:
        raise CodecError(f"bitstream uses level {header.level} that codec {header.codec!r} lacks")
    try:
        keys, values = impl.decode(header, sections, target, dtype)
    except CodecError:
        raise
    except _FOREIGN_ERRORS as e:
        raise CodecError(f"{header.codec} payload does not decode: {e}") from e
    if tuple(keys.shape) != header.shape or tuple(values.shape) != header.shape:
        raise CodecError(f"{header.codec} payload decoded to the wrong shape")
    return ChunkKV(
        keys=keys, values=values, positions=_positions(header, target), model_fingerprint=header.model_fingerprint
    )


def _positions(header: BitstreamHeader, device: torch.device) -> torch.Tensor:
    runs = [torch.arange(start, start + length, dtype=torch.int64) for start, length in header.position_runs]
    out = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64)
    return out.to(device)
