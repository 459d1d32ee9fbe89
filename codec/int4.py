"""``int4``: KIVI-style asymmetric 4-bit quantization (baseline)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ragkv.codec._quant import pack_nibbles, unpack_nibbles
from ragkv.codec._tensors import dequantize, section_array, to_bytes
from ragkv.codec.base import Codec
from ragkv.codec.header import BitstreamHeader
from ragkv.codec.payload import CodecPayload
from ragkv.codec.registry import register_codec
from ragkv.errors import CodecError

__all__ = ["Int4Codec"]

GROUP = 64  # tokens per key group, channels per value group


@register_codec
class Int4Codec(Codec):
    """KIVI's recipe: keys per channel over groups of tokens, values per token over groups of channels.

    Keys carry channel-wise outliers (a few channels are large for every token), values do not,
    hence the two directions. Each group stores an fp16 minimum and step; symbols are packed two
    per byte.

    Sections: for keys then values, steps fp16, minima fp16, packed nibbles.
    """

    name: ClassVar[str] = "int4"
    levels: ClassVar[tuple[int, ...]] = (0,)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, level: int) -> CodecPayload:
        sections: list[bytes] = []
        for x, dim in ((keys, 2), (values, 3)):
            if x.numel() == 0:
                sections += [b"", b"", b""]
                continue
            step, low, q = _quantize(_grouped(x.float(), dim, GROUP), dim + 1)
            sections += [to_bytes(step), to_bytes(low), pack_nibbles(q.numpy()).tobytes()]
        return CodecPayload(sections=tuple(sections), params={"group": GROUP})

    def check(self, header: BitstreamHeader) -> None:
        group = header.params.get("group")
        if not isinstance(group, int) or isinstance(group, bool) or not 1 <= group <= 1 << 16:
            raise CodecError(f"int4 payload has a malformed group size {group!r}")
        sizes: tuple[int, ...] = ()
        for dim in (2, 3):
            if math.prod(header.shape) == 0:
                sizes += (0, 0, 0)
                continue
            gshape, tshape = _table_shapes(header.shape, dim, group)
            table = 2 * math.prod(tshape)  # fp16 steps, then fp16 minima
            sizes += (table, table, (math.prod(gshape) + 1) // 2)
        if header.section_sizes != sizes:
            raise CodecError(f"int4 payload sections {header.section_sizes} do not hold {header.shape}")

    def decode(
        self,
        header: BitstreamHeader,
        sections: Sequence[memoryview],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = header.params["group"]  # checked by check()
        out = []
        for (steps, lows, packed), dim in ((sections[0:3], 2), (sections[3:6], 3)):
            if math.prod(header.shape) == 0:
                out.append(torch.empty(header.shape, device=device, dtype=dtype))
                continue
            gshape, tshape = _table_shapes(header.shape, dim, group)
            step = section_array(steps, "<f2", math.prod(tshape)).reshape(tshape).astype(np.float32)
            low = section_array(lows, "<f2", math.prod(tshape)).reshape(tshape).astype(np.float32)
            count = math.prod(gshape)
            q = unpack_nibbles(section_array(packed, "u1", (count + 1) // 2), count).reshape(gshape)
            out.append(_ungrouped(dequantize(q, step, low, device, dtype), dim, header.shape))
        return out[0], out[1]


def _grouped_shape(shape: tuple[int, int, int, int], dim: int, group: int) -> tuple[int, ...]:
    n = shape[dim]
    groups = max(1, math.ceil(n / group))
    size = min(group, n) if n else 0
    if dim == 2:  # [L, H, groups, size, D]
        return (shape[0], shape[1], groups, size if groups == 1 else group, shape[3])
    return (shape[0], shape[1], shape[2], groups, size if groups == 1 else group)


def _table_shapes(shape: tuple[int, int, int, int], dim: int, group: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the grouped symbols and of their per-group steps (and minima)."""
    gshape = _grouped_shape(shape, dim, group)
    tshape = (*gshape[:-2], 1, gshape[-1]) if dim == 2 else (*gshape[:-1], 1)
    return gshape, tshape


def _grouped(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    """``x`` padded along ``dim`` (repeating its last slice) and split into groups."""
    shape = _grouped_shape(tuple(x.shape), dim, group)  # type: ignore[arg-type]
    n = x.shape[dim]
    padded = shape[dim] * shape[dim + 1]
    if padded > n and n > 0:
        # replicate padding keeps the group's min and max those of its real members.
        moved = x.movedim(dim, -1).reshape(-1, 1, n)
        moved = F.pad(moved, (0, padded - n), mode="replicate").reshape(*x.movedim(dim, -1).shape[:-1], padded)
        x = moved.movedim(-1, dim)
    return x.reshape(shape)


def _ungrouped(x: torch.Tensor, dim: int, shape: tuple[int, int, int, int]) -> torch.Tensor:
    merged = x.reshape(*x.shape[:dim], -1, *x.shape[dim + 2 :])
    return merged.narrow(dim, 0, shape[dim]).contiguous()


def _quantize(x: torch.Tensor, gdim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of grouped ``x`` over its group axis ``gdim``.

    Returns fp16 steps and minima (the rounded values the decoder will use) and uint8 symbols.
    """
    low = x.amin(dim=gdim, keepdim=True).half()
    high = x.amax(dim=gdim, keepdim=True)
    step = ((high - low.float()) / 15.0).clamp_min(1e-8).half()
    q = torch.round((x - low.float()) / step.float()).clamp_(0, 15).to(torch.uint8)
    return step, low, q
