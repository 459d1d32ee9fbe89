"""Continuous batching over per-slot static caches: one forward pass advances every row by one token.

Each request owns a slot (a row) of preallocated K/V buffers ``[slots, kv_heads, capacity,
head_dim]`` per layer; a row's token at position p lives in column p of its slot, so rows of
different lengths sit side by side (ragged, no padding) and a step writes each row's new column
at its own position, in place. Columns past a row's length are masked out per row. A request
joins by copying its prompt's K/V into a free slot (its own row only) and leaves by freeing its
slot (no copy at all); the rows still decoding are never moved. The buffers are reallocated only
when a joining request needs more columns or slots than they have (capacity then at least
doubles, so that copy is amortized), and freed when the batch empties.

A step may also ride on a prefill piece's forward pass (:meth:`DecodeBatch.carried_step`,
Sarathi-Serve's mixed batch): the scheduler hands the piece a :class:`Rider` and the piece passes
it to ``ModelAdapter.forward(..., rider=...)``, so the rows' tokens share the piece's weight reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ragkv.model.attention import Carry, DecodeWeights, Steer, is_dispatched
from ragkv.model.caches import _layer_tensors
from ragkv.types import LogitsWanted

if TYPE_CHECKING:
    from ragkv.model.adapter import ModelAdapter

__all__ = ["DecodeBatch", "Rider", "one_row"]

_ALIGN = 64  # capacity is rounded up to a multiple of this many columns


class _BufferLayer(CacheLayerMixin):
    """A cache layer over preallocated K/V buffers ``[rows, kv_heads, capacity, head_dim]``, written in place."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys: torch.Tensor = keys
        self.values: torch.Tensor = values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise RuntimeError("batch cache layers are created initialized")

    def get_max_length(self) -> int:
        return int(self.keys.shape[-2])


class _SlotLayer(_BufferLayer):
    """One layer's K/V ``[B, kv_heads, capacity, head_dim]``; an update writes the next column in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(keys, values)
        self.length = 0  # slots in use (the next update writes slot ``length``)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states: [B, kv_heads, 1, head_dim], written at slot ``length`` of every row
        n = self.length
        self.keys[:, :, n : n + 1] = key_states
        self.values[:, :, n : n + 1] = value_states
        return self.keys[:, :, : n + 1], self.values[:, :, : n + 1]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0


class _SlotCache(Cache):
    def __init__(self, layers: list[Any]) -> None:
        super().__init__(layers=list[Any](layers))
        self.slot_layers = layers


class _RaggedLayer(_BufferLayer):
    """One layer's per-slot K/V ``[slots, kv_heads, capacity, head_dim]``; each row writes at its own column."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(keys, values)
        self.rows = torch.zeros(0, dtype=torch.long)  # [B] the step's rows (slots 0..B-1)
        self.write = torch.zeros(0, dtype=torch.long)  # [B] the column each row's new token goes to
        self.span = 0  # columns the step's queries may see (the longest row's, new token included)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states: [B, kv_heads, 1, head_dim]; row b's goes to column write[b] of slot b
        b = self.rows.numel()
        self.keys[self.rows, :, self.write] = key_states[:, :, 0]  # [B, kv_heads, head_dim]
        self.values[self.rows, :, self.write] = value_states[:, :, 0]
        return self.keys[:b, :, : self.span], self.values[:b, :, : self.span]

    def get_seq_length(self) -> int:
        return self.span

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0


@dataclass(frozen=True, slots=True)
class _StepRows:
    """One step's rows: every slot up to the last live one (a free slot decodes a dummy token at column 0)."""

    active: list[int]  # live slots, in order
    ids: torch.Tensor  # [B] each slot's token
    pos: torch.Tensor  # [B] each slot's position (= the column its token is written to)
    span: int  # columns the step's queries may see
    live: torch.Tensor  # [A] the live slots, as a tensor

    @property
    def count(self) -> int:
        return int(self.ids.numel())

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[B, 1, 1, span]``: each row sees its own columns up to its new token."""
        blocked = torch.arange(self.span, device=self.pos.device).unsqueeze(0) > self.pos.unsqueeze(1)  # [B, span]
        mask = torch.zeros(blocked.shape, dtype=dtype, device=self.pos.device)
        return mask.masked_fill_(blocked, torch.finfo(dtype).min)[:, None, None, :]


class _CarryCache(Cache):
    """A prefill piece's cache with a decode step's rows riding along (see ``DecodeBatch.carried_step``).

    A layer's K/V ``[1, kv_heads, p + B, head_dim]`` splits: the first ``p`` columns are appended to
    the piece's own cache (whose whole K/V the layer's attention then reads), the last ``B`` go to
    each row's slot in the batch buffers (read by the attention's split: ``ragkv.model.attention.Carry``).
    """

    def __init__(self, piece_cache: Cache, rows: list[_RaggedLayer], piece_tokens: int) -> None:
        super().__init__(layers=list[Any](piece_cache.layers))
        self._piece, self._rows, self._p = piece_cache, rows, piece_tokens
        self._row_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._p
        keys, values = self._piece.update(key_states[:, :, :p], value_states[:, :, :p], layer_idx, *args, **kwargs)
        row_k = key_states[0, :, p:].transpose(0, 1).unsqueeze(2)  # [B, kv_heads, 1, head_dim]
        row_v = value_states[0, :, p:].transpose(0, 1).unsqueeze(2)
        self._row_kv[layer_idx] = self._rows[layer_idx].update(row_k, row_v)
        return keys, values

    def row_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' K/V ``[B, kv_heads, span, head_dim]`` of ``layer_idx`` (after its update)."""
        return self._row_kv[layer_idx]


class DecodeBatch:
    """The rows being decoded together, each in its own slot of static caches.

    Args:
        adapter: the model.
        weights: the weights a step reads: ``"model"``, or an ``"int8"``/``"int4"`` copy
            (``ragkv.model.quant``; made here, once per model, on the CPU only).
    """

    def __init__(self, adapter: ModelAdapter, *, weights: DecodeWeights = "model") -> None:
        self.adapter = adapter
        self.weights: DecodeWeights = weights
        self._step = Steer(kind="decode", weights=weights)  # what a step's pass does (ragkv.model.attention)
        adapter.model_for(weights)  # the quantized copy, made now (a bad format or device raises here)
        self._owner: list[str | None] = []  # slot -> request id (None: free)
        self._length: list[int] = []  # slot -> tokens filled (the next token's position and column)
        self._layers: list[_RaggedLayer] = []

    def __len__(self) -> int:
        return sum(k is not None for k in self._owner)

    @property
    def keys(self) -> list[str]:
        """The request ids decoding, in slot order (the order :meth:`step` takes tokens and returns logits)."""
        return [k for k in self._owner if k is not None]

    @property
    def step_rows(self) -> int:
        """Rows a step runs: every slot up to the last live one (a free slot among them decodes a dummy token)."""
        return len(self._owner)

    @property
    def capacity(self) -> int:
        """Columns per slot (0 while empty)."""
        return int(self._layers[0].keys.shape[2]) if self._layers else 0

    def add(self, key: str, cache: Cache, num_tokens: int, reserve: int = 0) -> None:
        """Add a request whose prompt (and any tokens fed so far) fill ``cache``'s first ``num_tokens`` slots.

        Its next token goes at position ``num_tokens``. ``reserve``: tokens it may still decode;
        with it, the buffers are sized once and no later step needs to grow them. Only this
        request's K/V are copied (into a free slot), unless the buffers must grow.
        """
        if key in self._owner:
            raise ValueError(f"request {key!r} is already in the batch")
        new = [_layer_tensors(layer) for layer in cache.layers]  # [1, H, >=num_tokens, D] each
        if new[0][0].shape[2] < num_tokens:
            raise ValueError(f"the cache holds {new[0][0].shape[2]} slots, fewer than the prompt's {num_tokens}")
        slot = self._owner.index(None) if None in self._owner else len(self._owner)
        self._reserve(new[0][0], slot + 1, num_tokens + max(reserve, 1))
        for layer, (k, v) in zip(self._layers, new, strict=True):
            layer.keys[slot, :, :num_tokens] = k[0, :, :num_tokens]
            layer.values[slot, :, :num_tokens] = v[0, :, :num_tokens]
        if slot == len(self._owner):
            self._owner.append(None)
            self._length.append(0)
        self._owner[slot], self._length[slot] = key, num_tokens

    def remove(self, key: str) -> None:
        """Free a request's slot (nothing is copied; the buffers go once the batch is empty)."""
        slot = self._owner.index(key)
        self._owner[slot], self._length[slot] = None, 0
        while self._owner and self._owner[-1] is None:
            self._owner.pop()
            self._length.pop()
        if not self._owner:
            self._layers = []

    def can_carry(self) -> bool:
        """Whether a step of this batch may ride on another forward pass (:meth:`carried_step`).

        Only when decode steps read the model's own weights (an int8/int4 step reads other weights
        than the prefill it would ride on) and on the CPU (where a step is the fp32 one-query path
        either way, so a carried step computes what a step of its own would), while the model runs
        ragkv's attention dispatcher (which splits the pass's attention).
        """
        a = self.adapter
        return len(self) > 0 and self.weights == "model" and a.device.type == "cpu" and is_dispatched(a.model)

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row (in :attr:`keys` order); return fp32 logits ``[B, vocab]`` of the next tokens."""
        rows = self._start_step(token_ids)
        a = self.adapter
        hidden = a.embed(rows.ids).reshape(rows.count, 1, -1)  # [B, 1, hidden]
        pe = a.position_embeddings(rows.pos.unsqueeze(1), hidden)
        # [B, 1, 1, span]; one row alone sees all its columns: no mask (as a static decoder's step, exactly)
        mask = rows.mask(hidden.dtype) if rows.count > 1 else None
        # one query per row: fp32 attention on the CPU (ragkv.model.attention); the engine's decode weights
        hidden = a.run_layers(hidden, rows.pos.unsqueeze(1), _SlotCache(self._layers), pe, mask, self._step)
        # [A, vocab]: the head on live rows only
        logits = a.final_logits(hidden.index_select(0, rows.live), self.weights)[:, -1]
        self._end_step(rows)
        return logits

    @torch.no_grad()
    def carried_step(
        self, token_ids: list[int], piece: torch.Tensor, cache: Cache, start: int, logits: LogitsWanted
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill piece and one decode step of every row, in one forward pass (Sarathi-Serve's mixed batch).

        ``piece`` (``[p]`` token ids at positions ``start..``) is appended to ``cache`` as
        ``ModelAdapter.forward`` would; the rows' tokens ride along as :meth:`step` would feed
        them. The p + B tokens share every weight read (the linear layers and the LM head); only
        attention is split: the piece's queries over its own cache (the model's implementation,
        causal), each row's query over its own slot (fp32, as a step of its own). On a CPU a
        prefill piece is compute-bound and a step bound by the weight bytes it reads, so the rows'
        tokens cost almost nothing on top of the piece.

        Returns:
            (the piece's fp32 logits as ``logits`` asks: ``[p | 1 | 0, vocab]``, the rows' ``[A, vocab]``).
        """
        if not self.can_carry():
            raise RuntimeError("this batch's steps cannot be carried (see can_carry())")
        if cache.get_seq_length() != start:
            raise ValueError(f"the piece starts at {start} but its cache holds {cache.get_seq_length()} tokens")
        rows = self._start_step(token_ids)
        a = self.adapter
        p = int(piece.numel())
        ids = torch.cat([piece.reshape(-1).to(device=a.device, dtype=torch.long), rows.ids])  # [p + B]
        hidden = a.embed(ids)  # [1, p + B, hidden]
        positions = torch.cat([torch.arange(start, start + p, device=a.device), rows.pos])  # [p + B]
        pe = a.position_embeddings(positions.unsqueeze(0), hidden)
        piece_mask = a.causal_mask(torch.arange(start, start + p), start + p, hidden.dtype)  # [1, 1, p, start + p]
        mixed = _CarryCache(cache, self._layers, p)
        carry = Steer(carry=Carry(p, rows.mask(hidden.dtype), mixed.row_kv))
        hidden = a.run_layers(hidden, positions.unsqueeze(0), mixed, pe, piece_mask, carry)
        piece_rows = torch.arange({"all": 0, "last": p - 1, "none": p}[logits], p)  # where the piece wants logits
        at = torch.cat([piece_rows, p + rows.live.cpu()]).to(a.device)
        out = a.final_logits(hidden.index_select(1, at))[0]  # [n, vocab]: one LM head read for both
        n_piece = out.shape[0] - rows.live.numel()
        self._end_step(rows)  # last: a step that raised leaves the rows where they were (the next step rewrites)
        return out[:n_piece], out[n_piece:]

    def _start_step(self, token_ids: list[int]) -> _StepRows:
        """Check the tokens, grow the buffers if a row needs a column more, point the layers at the new columns."""
        active = [slot for slot, k in enumerate(self._owner) if k is not None]
        if len(token_ids) != len(active):
            raise ValueError(f"need one token per row ({len(active)}), got {len(token_ids)}")
        device = self.adapter.device
        b = len(self._owner)  # rows 0..b-1 run; a free slot among them decodes a dummy token at column 0
        write = [0] * b
        ids = [0] * b
        for slot, tok in zip(active, token_ids, strict=True):
            write[slot], ids[slot] = self._length[slot], tok
        span = max(write) + 1
        if span > self.capacity:
            self._reserve(self._layers[0].keys, b, span)
        pos = torch.tensor(write, dtype=torch.long, device=device)  # [B]: each row's own position (= its column)
        for layer in self._layers:
            layer.rows, layer.write, layer.span = torch.arange(b, device=device), pos, span
        live = torch.tensor(active, dtype=torch.long, device=device)
        return _StepRows(active, torch.tensor(ids, dtype=torch.long, device=device), pos, span, live)

    def _end_step(self, rows: _StepRows) -> None:
        for slot in rows.active:
            self._length[slot] += 1

    def _reserve(self, like: torch.Tensor, slots: int, columns: int) -> None:
        """Make the buffers hold at least ``slots`` rows of ``columns`` columns (growing at least 2x)."""
        have_slots = int(self._layers[0].keys.shape[0]) if self._layers else 0
        have_cols = self.capacity
        if slots <= have_slots and columns <= have_cols:
            return
        new_slots = max(slots, min(2 * have_slots, slots + 8)) if slots > have_slots else have_slots
        new_cols = max(columns, 2 * have_cols) if columns > have_cols else have_cols
        new_cols = -(-new_cols // _ALIGN) * _ALIGN
        n_layers = len(self._layers) or self.adapter.spec.num_layers
        layers = []
        for i in range(n_layers):
            # zeros, not empty: a masked column still enters attention (weight 0), and garbage could be NaN
            shape = (new_slots, like.shape[1], new_cols, like.shape[3])
            keys, values = like.new_zeros(shape), like.new_zeros(shape)
            if self._layers:
                old = self._layers[i]
                keys[:have_slots, :, :have_cols] = old.keys
                values[:have_slots, :, :have_cols] = old.values
            layers.append(_RaggedLayer(keys, values))
        self._layers = layers


@dataclass(slots=True)
class Rider:
    """A decode step of ``batch`` offered to a prefill piece's forward pass.

    The scheduler offers one to each prefill piece (``RagKV.prefill_steps(riders=...)``); a full
    prefill's piece passes it to ``ModelAdapter.forward(..., rider=...)``, which runs
    :meth:`DecodeBatch.carried_step` and leaves the rows' logits here. ``logits`` still None after
    the piece: nothing carried it (a fused piece, say), and the scheduler steps on its own.
    """

    batch: DecodeBatch
    tokens: list[int]  # one per row, in the batch's key order
    logits: torch.Tensor | None = None  # [A, vocab] once carried


def one_row(
    adapter: ModelAdapter, cache: Cache, num_tokens: int, reserve: int, weights: DecodeWeights = "model"
) -> Callable[[int], torch.Tensor]:
    """One prompt's decode steps as a function: feed a token, get the next token's fp32 logits ``[vocab]``.

    A batch of one row over ``cache``'s first ``num_tokens`` slots, with room for ``reserve``
    tokens (the step an answer runs, for benchmarks and tests that feed tokens themselves).
    """
    batch = DecodeBatch(adapter, weights=weights)
    batch.add("row", cache, num_tokens, reserve=reserve)
    return lambda token: batch.step([token])[0]
