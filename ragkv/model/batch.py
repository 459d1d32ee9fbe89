"""Continuous batching over per-slot static caches: one forward pass advances every row by one token.

Each request owns a slot (a row) of preallocated K/V buffers ``[slots, kv_heads, capacity,
head_dim]`` per layer; a row's token at position p lives in column p of its slot, so rows of
different lengths sit side by side (ragged, no padding) and a step writes each row's new column
at its own position, in place. Columns past a row's length are masked out per row. A request
joins by copying its prompt's K/V into a free slot (its own row only) and leaves by freeing its
slot (no copy at all); the rows still decoding are never moved. The buffers are reallocated only
when a joining request needs more columns or slots than they have (capacity then at least
doubles, so that copy is amortized), and freed when the batch empties.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ragkv.model.attention import decode_step
from ragkv.model.caches import _layer_tensors, cache_kwarg
from ragkv.model.quant import step_weights

__all__ = ["DecodeBatch"]

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


class DecodeBatch:
    """The rows being decoded together, each in its own slot of static caches.

    Args:
        adapter: the model (a ``ModelAdapter``).
        weights: the weights a step reads: ``"model"``, or an installed ``"int8"``/``"int4"`` copy.
    """

    def __init__(self, adapter: Any, *, weights: str = "model") -> None:
        self.adapter = adapter
        self.weights = weights
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

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row (in :attr:`keys` order); return fp32 logits ``[B, vocab]`` of the next tokens."""
        active = [slot for slot, k in enumerate(self._owner) if k is not None]
        if len(token_ids) != len(active):
            raise ValueError(f"need one token per row ({len(active)}), got {len(token_ids)}")
        a = self.adapter
        device = a.device
        b = len(self._owner)  # rows 0..b-1 run; a free slot among them decodes a dummy token at column 0
        write = [0] * b
        ids = [0] * b
        for slot, tok in zip(active, token_ids, strict=True):
            write[slot], ids[slot] = self._length[slot], tok
        span = max(write) + 1
        if span > self.capacity:
            self._reserve(self._layers[0].keys, b, span)
        pos = torch.tensor(write, dtype=torch.long)  # [B]: each row's own position (= its column)
        for layer in self._layers:
            layer.rows, layer.write, layer.span = torch.arange(b, device=device), pos.to(device), span
        pos_d = pos.to(device).unsqueeze(1)  # [B, 1]
        hidden = a.embed(torch.tensor(ids, dtype=torch.long)).reshape(b, 1, -1)  # [B, 1, hidden]
        pe = a._inner.rotary_emb(hidden, pos_d)
        blocked = torch.arange(span, device=device).unsqueeze(0) > pos_d  # [B, span]: past each row's token
        mask = torch.zeros(blocked.shape, dtype=hidden.dtype, device=device)
        mask = mask.masked_fill_(blocked, torch.finfo(hidden.dtype).min)[:, None, None, :]  # [B, 1, 1, span]
        cache = _SlotCache(self._layers)
        # one query per row: fp32 attention on the CPU (ragkv.model.attention); the engine's decode weights
        with step_weights(self.weights), decode_step():
            for layer in a._inner.layers:
                out = layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=pos_d,
                    use_cache=True,
                    position_embeddings=pe,
                    **{cache_kwarg(type(layer)): cache},
                )
                hidden = out[0] if isinstance(out, tuple) else out
        for slot in active:
            self._length[slot] += 1
        rows = torch.tensor(active, dtype=torch.long, device=device)
        return a.final_logits(hidden.index_select(0, rows))[:, -1]  # [A, vocab]: the head on live rows only

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
