"""``raw``: keys and values as fp16, nothing else."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from ragkv.codec._tensors import from_section, to_bytes
from ragkv.codec.base import Codec
from ragkv.codec.header import BitstreamHeader
from ragkv.codec.payload import CodecPayload
from ragkv.codec.registry import register_codec
from ragkv.errors import CodecError

__all__ = ["RawCodec"]


@register_codec
class RawCodec(Codec):
    """fp16 keys then fp16 values, row-major: the reference every lossy codec is measured against.

    fp16 inputs round-trip bit-exactly. Wider inputs are rounded to fp16; values outside fp16's
    range are refused rather than turned into infinities.
    """

    name: ClassVar[str] = "raw"
    levels: ClassVar[tuple[int, ...]] = (0,)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, level: int) -> CodecPayload:
        sections = []
        for t in (keys, values):
            half = t.to(torch.float16)
            if not bool(torch.isfinite(half).all()):
                raise ValueError(
                    "KV values exceed the fp16 range, so the raw codec cannot store them; "
                    "use a quantizing codec (int8, cachegen)"
                )
            sections.append(to_bytes(half))
        return CodecPayload(sections=tuple(sections))

    def check(self, header: BitstreamHeader) -> None:
        nbytes = 2 * math.prod(header.shape)  # fp16
        if header.section_sizes != (nbytes, nbytes):
            raise CodecError(f"raw payload sections {header.section_sizes} do not hold fp16 {header.shape}")

    def decode(
        self,
        header: BitstreamHeader,
        sections: Sequence[memoryview],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = from_section(sections[0], torch.float16, header.shape, device, dtype)
        values = from_section(sections[1], torch.float16, header.shape, device, dtype)
        return keys, values


def raw_views(header: BitstreamHeader, sections: Sequence[memoryview]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a raw payload as fp16 views of its sections (no copy; read-only: the bytes
    may be a tier's own). A misaligned section is copied once."""
    out = []
    for section in sections[:2]:
        if len(section) != 2 * math.prod(header.shape):
            raise CodecError(f"raw payload section holds {len(section)} bytes, not fp16 {header.shape}")
        buf = section if np.frombuffer(section, dtype=np.uint8).ctypes.data % 2 == 0 else bytes(section)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the caller only reads it
            out.append(torch.frombuffer(buf, dtype=torch.float16).view(header.shape))
    return out[0], out[1]
