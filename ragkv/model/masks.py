"""The exact causal mask of a fused pass, made only where an attention call needs it.

Fusion's passes run rows at scattered slots of the fused cache: the row at slot ``p`` sees the
slots up to ``p``. As a tensor that is ``[rows, slots]``, and it grows with both: a recompute's
first layers run 40% of the chunk tokens, so 6,400 rows over 16K slots are 200 MB in bf16, 13K over
32K 0.8 GB, 51K over 128K 13 GB (on a GPU beyond a full prefill's peak, which needs no mask; on a CPU
built by two cores at every change of the active rows). Fusion hands its layers a
:class:`PositionMask` instead (the decoder layers pass their mask on to the attention function
untouched), and ragkv's dispatcher (:mod:`ragkv.model.attention`) makes of it what the call needs:

- ragkv's CPU kernel computes from the positions: no mask at all; so does a GPU's Triton kernel
  (``ragkv.gpu.attention``), which fusion hands over as the mask's :attr:`PositionMask.kernel`;
- a mask of up to :data:`MASK_BLOCK_BYTES`: the tensor, built at the first call that needs it and
  shared by every later layer (as the mask built up front was);
- a larger one: the attention runs a block of rows at a time (:meth:`PositionMask.blocks`), each
  over the slots up to its last row's, with its block of the mask, made for the call and freed after
  it. Rows are independent in attention, and the slots cut off are masked for every row of the
  block, so each row's output is what the whole mask gives (within rounding: a kernel may order
  its sums by the keys' count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["MASK_ALIGN", "MASK_BLOCK_BYTES", "PositionKernel", "PositionMask", "causal_mask_at"]

MASK_ALIGN = 16  # elements per mask row, rounded up to this: see causal_mask_at
MASK_BLOCK_BYTES = 64 << 20  # a pass's mask above this is made a block of rows at a time

# An attention kernel computing the mask's call from the positions: ``(query [1, Hq, q, D], key and
# value [1, Hkv, slots, D], the queries' slots [q] int64 on the device, scale or None)`` to the output
# ``[1, q, Hq, D]``, or None for a call it does not take (the dispatcher then uses the mask).
PositionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor | None]


def causal_mask_at(query_pos: torch.Tensor, num_keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask ``[1, 1, q, num_keys]`` in ``dtype`` for queries at slots ``query_pos`` ``[q]``:
    0 where the query at ``p`` sees the slot (slots ``<= p``), the dtype's minimum elsewhere.

    Rows are padded to :data:`MASK_ALIGN` elements: SDPA's memory-efficient CUDA kernel takes a mask
    whose strides are multiples of 16 as it is, and pads a copy on every call otherwise. Not a bool
    mask: SDPA turns a bool mask into a float one on every call.
    """
    q = int(query_pos.numel())
    keys = torch.arange(num_keys, device=device)
    blocked = keys.unsqueeze(0) > query_pos.to(device, non_blocking=True).unsqueeze(1)  # [q, keys]
    width = -(-num_keys // MASK_ALIGN) * MASK_ALIGN
    mask = torch.zeros((1, 1, q, width), dtype=dtype, device=device)[..., :num_keys]
    return mask.masked_fill_(blocked, torch.finfo(dtype).min)


class PositionMask:
    """The exact causal mask of queries at slots ``query_pos`` over ``num_keys`` slots, made on demand.

    Args:
        query_pos: ``[q]`` int64 on the host: each query's slot (reading them costs no device sync).
        num_keys: the slots of the cache the queries attend over.
        dtype: the mask's dtype (the model's).
        device: where its tensors are made (the model's device).
        device_pos: ``query_pos`` already on ``device``, where the caller has it (else it is copied
            there when the mask is first made: from pageable memory a copy waits for the device).
        block_bytes: masks above this many bytes are only made a block of rows at a time (None:
            :data:`MASK_BLOCK_BYTES`, read when the mask is made).
        kernel: a :data:`PositionKernel` the dispatcher asks first for a plain call over exactly these
            rows and slots (a GPU's, ``ragkv.gpu.attention``): no mask is made for the calls it takes.
            Kept only where every position is a key slot.
    """

    def __init__(
        self,
        query_pos: torch.Tensor,
        num_keys: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        device_pos: torch.Tensor | None = None,
        block_bytes: int | None = None,
        kernel: PositionKernel | None = None,
    ) -> None:
        if query_pos.device.type != "cpu" or query_pos.dim() != 1:
            raise ValueError("PositionMask takes the queries' slots as a 1-D host tensor")
        self.query_pos = query_pos.to(torch.int64)
        self.num_keys, self.dtype, self.device = num_keys, dtype, device
        self.block_bytes = MASK_BLOCK_BYTES if block_bytes is None else block_bytes
        self._device_pos = device_pos
        # the kernel reads the positions unchecked: it is kept only where they are key slots (they are in
        # fusion; a mask made of others gives its calls to the mask's path)
        inside = (
            kernel is None or not self.rows or 0 <= int(self.query_pos.min()) <= int(self.query_pos.max()) < num_keys
        )
        self.kernel = kernel if inside else None
        self._dense: torch.Tensor | None = None
        self._spans: list[tuple[int, int, int]] | None = None  # (start, end, cut) per block, made once

    @property
    def rows(self) -> int:
        """The queries the mask is for."""
        return int(self.query_pos.numel())

    @property
    def nbytes(self) -> int:
        """What the whole mask takes as a tensor (rows padded as :func:`causal_mask_at` pads them)."""
        width = -(-self.num_keys // MASK_ALIGN) * MASK_ALIGN
        return self.rows * width * self.dtype.itemsize

    @property
    def blocked(self) -> bool:
        """Whether the whole mask is too large to make (:attr:`block_bytes`): calls run by blocks of rows."""
        return self.nbytes > self.block_bytes

    def dense(self) -> torch.Tensor:
        """The whole mask ``[1, 1, q, num_keys]``, made at the first call and kept (every layer shares it)."""
        if self._dense is None:
            self._dense = causal_mask_at(self._on_device(), self.num_keys, self.dtype, self.device)
        return self._dense

    def spans(self) -> list[tuple[int, int, int]]:
        """``(start, end, cut)`` per block of rows: rows ``start:end`` see no slot at or after ``cut`` (their
        last slot + 1). A block's mask takes at most :attr:`block_bytes` (at least 16 rows a block).
        Worked out once, on the host."""
        if self._spans is None:
            width = -(-self.num_keys // MASK_ALIGN) * MASK_ALIGN
            per_block = max(MASK_ALIGN, self.block_bytes // (width * self.dtype.itemsize))
            starts = list(range(0, self.rows, per_block))
            pos = self.query_pos.tolist()
            last = [max(pos[a : a + per_block]) for a in starts]
            self._spans = [
                (a, min(self.rows, a + per_block), min(self.num_keys, m + 1)) for a, m in zip(starts, last, strict=True)
            ]
        return self._spans

    def blocks(self) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(start, end, cut, mask)`` per block of :meth:`spans`, ``mask`` ``[1, 1, end - start, cut]``
        the rows' over slots ``:cut``, made as it is asked for (a caller that drops each before asking
        for the next holds one block's mask at a time: at most :attr:`block_bytes`, and half that
        again while it is made)."""
        on_device = self._on_device()
        for start, end, cut in self.spans():
            yield start, end, cut, causal_mask_at(on_device[start:end], cut, self.dtype, self.device)

    def device_positions(self) -> torch.Tensor:
        """The queries' slots ``[q]`` int64 on :attr:`device` (copied there once)."""
        return self._on_device()

    def _on_device(self) -> torch.Tensor:
        if self._device_pos is None:
            self._device_pos = self.query_pos.to(self.device, non_blocking=True)
        elif self._device_pos.dtype != torch.int64 or not self._device_pos.is_contiguous():
            self._device_pos = self._device_pos.to(torch.int64).contiguous()
        return self._device_pos

    def __repr__(self) -> str:
        return f"PositionMask(rows={self.rows}, num_keys={self.num_keys}, dtype={self.dtype}, blocked={self.blocked})"
