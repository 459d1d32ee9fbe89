"""A persistent padded batch of decoding requests: one forward pass advances every row by one token.

Rows are right-aligned (left padding): every row's newest token sits in the same slot, so one
step writes one column for the whole batch. Each row keeps its own positions and a padding
width; padding slots are masked out per row. The buffers have spare capacity that grows by
doubling, so a step writes one column in place and never copies the caches; they are re-packed
only when a row joins or leaves.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ragkv.model.attention import decode_step
from ragkv.model.caches import _layer_tensors, cache_kwarg
from ragkv.model.quant import step_weights

__all__ = ["DecodeBatch"]

_SPARE = 64  # free columns allocated past the longest row at each re-pack


class _SlotLayer(CacheLayerMixin):
    """One layer's K/V ``[B, kv_heads, capacity, head_dim]``; an update writes the next column in place."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys: torch.Tensor = keys
        self.values: torch.Tensor = values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.length = 0  # slots in use (the next update writes slot ``length``)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise RuntimeError("batch cache layers are created initialized")

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

    def get_max_length(self) -> int:
        return int(self.keys.shape[-2])


class _SlotCache(Cache):
    def __init__(self, layers: list[_SlotLayer]) -> None:
        super().__init__(layers=list[Any](layers))
        self.slot_layers = layers


class DecodeBatch:
    """The rows being decoded together, and their caches.

    Args:
        adapter: the model (a ``ModelAdapter``).
    """

    def __init__(self, adapter: Any, *, weights: str = "model") -> None:
        self.adapter = adapter
        self.weights = weights  # the weights a step reads: "model", or an installed "int8"/"int4" copy
        self.keys: list[str] = []  # row -> request id
        self._layers: list[_SlotLayer] = []
        self._pad = torch.zeros(0, dtype=torch.long)  # [B] padding slots at the left of each row
        self._next_pos = torch.zeros(0, dtype=torch.long)  # [B] position of each row's next token
        self._length = 0  # slots in use, the same for every row

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: str, cache: Cache, num_tokens: int) -> None:
        """Add a request whose prompt (and any tokens fed so far) fill ``cache``'s first ``num_tokens`` slots.

        Its next token goes at position ``num_tokens``. Re-packs the batch (a copy of every row).
        """
        if key in self.keys:
            raise ValueError(f"request {key!r} is already in the batch")
        new = [_layer_tensors(layer) for layer in cache.layers]  # [1, H, >=num_tokens, D] each
        length = max(self._length, num_tokens)
        capacity = length + _SPARE
        grow = length - self._length  # extra left padding for the rows already here
        layers = []
        for i, (k, v) in enumerate(new):
            shape = (len(self.keys) + 1, k.shape[1], capacity, k.shape[3])
            keys, values = k.new_zeros(shape), v.new_zeros(shape)
            if self._layers:
                old = self._layers[i]
                keys[:-1, :, grow:length] = old.keys[:, :, : self._length]
                values[:-1, :, grow:length] = old.values[:, :, : self._length]
            keys[-1, :, length - num_tokens : length] = k[0, :, :num_tokens]
            values[-1, :, length - num_tokens : length] = v[0, :, :num_tokens]
            layers.append(_SlotLayer(keys, values))
        self._set(layers, length)
        self._pad = torch.cat([self._pad + grow, torch.tensor([length - num_tokens])])
        self._next_pos = torch.cat([self._next_pos, torch.tensor([num_tokens])])
        self.keys.append(key)

    def remove(self, key: str) -> None:
        """Drop a request's row; leading columns that are now padding in every row are trimmed."""
        row = self.keys.index(key)
        keep = torch.tensor([i for i in range(len(self.keys)) if i != row], dtype=torch.long)
        self.keys.pop(row)
        pad = self._pad[keep]
        trim = int(pad.min()) if len(keep) else self._length
        length = self._length - trim
        layers = []
        for old in self._layers:
            idx = keep.to(old.keys.device)
            keys = old.keys.index_select(0, idx)[:, :, trim:].contiguous()
            values = old.values.index_select(0, idx)[:, :, trim:].contiguous()
            layers.append(_SlotLayer(keys, values))
        self._set(layers, length)
        self._pad, self._next_pos = pad - trim, self._next_pos[keep]

    @torch.no_grad()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row (in row order); return fp32 logits ``[B, vocab]`` of the next tokens."""
        if len(token_ids) != len(self.keys):
            raise ValueError(f"need one token per row ({len(self.keys)}), got {len(token_ids)}")
        if self._length == self._layers[0].keys.shape[2]:
            self._grow()
        a = self.adapter
        device = a.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device).unsqueeze(1)  # [B, 1]
        pos = self._next_pos.to(device).unsqueeze(1)  # [B, 1]: each row's own position
        hidden = a.embed(ids).reshape(len(token_ids), 1, -1)  # [B, 1, hidden]
        pe = a._inner.rotary_emb(hidden, pos)
        slots = torch.arange(self._length + 1, device=device)
        blocked = slots.unsqueeze(0) < self._pad.to(device).unsqueeze(1)  # [B, slots]: padding
        mask = torch.zeros(blocked.shape, dtype=hidden.dtype, device=device)
        mask.masked_fill_(blocked, torch.finfo(hidden.dtype).min)
        mask = mask[:, None, None, :]  # [B, 1, 1, slots]
        cache = _SlotCache(self._layers)
        # one query per row: fp32 attention on the CPU (ragkv.model.attention); the engine's decode weights
        with step_weights(self.weights), decode_step():
            for layer in a._inner.layers:
                out = layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=pos,
                    use_cache=True,
                    position_embeddings=pe,
                    **{cache_kwarg(type(layer)): cache},
                )
                hidden = out[0] if isinstance(out, tuple) else out
        self._set(self._layers, self._length + 1)
        self._next_pos = self._next_pos + 1
        return a.final_logits(hidden)[:, -1]  # [B, vocab]

    def _grow(self) -> None:
        """Double the free columns (amortized: a step never copies the caches)."""
        layers = []
        for old in self._layers:
            b, h, cap, d = old.keys.shape
            keys, values = old.keys.new_zeros((b, h, 2 * cap, d)), old.values.new_zeros((b, h, 2 * cap, d))
            keys[:, :, :cap], values[:, :, :cap] = old.keys, old.values
            layers.append(_SlotLayer(keys, values))
        self._set(layers, self._length)

    def _set(self, layers: list[_SlotLayer], length: int) -> None:
        for layer in layers:
            layer.length = length
        self._layers, self._length = layers, length
