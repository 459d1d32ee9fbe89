"""The interface every codec implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from ragkv.codec.header import BitstreamHeader
from ragkv.codec.payload import CodecPayload
from ragkv.codec.transform import ChannelTransform

__all__ = ["Codec"]


class Codec(ABC):
    """Turns a chunk's keys and values into payload sections and back.

    A codec sees tensors and bytes only; framing, checksums, positions and the model fingerprint
    are the bitstream layer's job. Subclasses set ``name`` and ``levels`` and are made known with
    :func:`ragkv.codec.register_codec`. Codecs are stateless: one instance serves every call.
    """

    name: ClassVar[str]  # registry name, stored in every bitstream the codec writes
    levels: ClassVar[tuple[int, ...]]  # quality levels, lowest = most faithful

    @abstractmethod
    def encode(self, keys: torch.Tensor, values: torch.Tensor, level: int) -> CodecPayload:
        """Encode one chunk.

        Args:
            keys: ``[layers, kv_heads, tokens, head_dim]`` on CPU, floating point, finite.
            values: same shape as ``keys``.
            level: one of ``self.levels``.

        Returns:
            The payload sections and the parameters the decoder needs.
        """

    def wants_saliency(self, level: int) -> bool:
        """Whether ``level`` spends precision by token saliency (worth measuring it at index time)."""
        return False

    def encode_salient(
        self, keys: torch.Tensor, values: torch.Tensor, level: int, saliency: torch.Tensor | None
    ) -> CodecPayload:
        """Encode one chunk, given how much each token matters (see :func:`ragkv.codec.encode`).

        ``saliency`` is ``[tokens]`` (higher: more salient), or None when the caller has none. A
        codec that spends precision per token overrides this; the default ignores it.
        """
        return self.encode(keys, values, level)

    def encode_transformed(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        level: int,
        saliency: torch.Tensor | None,
        transform: ChannelTransform,
        positions: torch.Tensor,
    ) -> CodecPayload:
        """Encode one chunk in a model's channel transform (a codec that can overrides this).

        ``positions`` ``[tokens]`` are the chunk's stored positions (the transform rotates keys
        back from them). The decoder returns the transformed tensors; ``api.decode`` inverts.

        Raises:
            ValueError: this codec cannot code in a channel transform.
        """
        raise ValueError(f"codec {self.name!r} cannot use a channel transform; use cachegen or pass none")

    def check(self, header: BitstreamHeader) -> None:
        """Refuse a header whose payload sections cannot hold its shape, before anything is allocated.

        Runs on every decode, after the header and the bitstream's length are checked and before
        the payload is hashed or :meth:`decode` allocates its output. A codec whose section sizes
        follow from the shape checks them here, so that a crafted header cannot make the decoder
        allocate for a tensor its bytes do not hold. The default accepts every header.

        Raises:
            CodecError: the sections (or parameters) do not fit ``header.shape``.
        """
        return None

    # Every codec restates this signature on purpose: the override is typed in full, so mypy
    # checks each codec's decode against it and readers see its arguments where it is defined.
    @abstractmethod
    def decode(
        self,
        header: BitstreamHeader,
        sections: Sequence[memoryview],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode one chunk's payload.

        Args:
            header: the header, already passed by :meth:`check`; ``header.shape`` is the shape to return.
            sections: the payload sections, read-only views.
            device: where the returned tensors go; dequantization runs there.
            dtype: dtype of the returned tensors.

        Returns:
            ``(keys, values)``, each ``[layers, kv_heads, tokens, head_dim]``.

        Raises:
            CodecError: the sections do not decode to what the header says.
        """
