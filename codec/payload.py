"""What a codec hands the bitstream layer: its parameters and its payload sections."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["CodecPayload"]


@dataclass(frozen=True, slots=True)
class CodecPayload:
    """A codec's encoding of one chunk, before framing.

    ``params`` goes into the JSON header (so it must hold JSON values only: numbers, strings,
    lists, objects); ``sections`` are the binary payload, in the order the decoder reads them.
    """

    sections: tuple[bytes, ...]  # payload sections: tables first, then coded streams
    params: Mapping[str, Any] = field(default_factory=dict)  # JSON-able codec parameters

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
