"""The decode step at the memory limit: a static KV cache, fp32 one-query attention, optional int8/int4 weights.

gpt-fast's recipe on the model's own layers: the prompt's K/V are copied once into buffers sized
for the whole answer, so a step writes one column in place (a ``DynamicCache`` concatenates, a
copy of every layer per token); a step calls the decoder layers directly (no mask to build: one
query sees every slot written so far) with rotary tables computed once per answer; attention of
the single query runs in fp32 (see ``ragkv.model.attention.decode_step``). With
``weights="int8"`` (or ``"int4"``) the linear layers and the LM head read weight-only copies
during decode steps (prefill and fusion keep the model's weights; ``ragkv.model.quant``), halving
(quartering) the bytes a bf16 step streams: a lossy setting, named in the stats, never a default.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, get_args

import torch
from transformers.cache_utils import Cache

from ragkv.model.attention import DecodeWeights, Steer
from ragkv.model.batch import _SlotCache, _SlotLayer
from ragkv.model.caches import _layer_tensors

logger = logging.getLogger(__name__)

__all__ = ["DECODE_WEIGHTS", "DecodeSession", "DecodeWeights", "StaticDecoder"]

DECODE_WEIGHTS: tuple[str, ...] = get_args(DecodeWeights)


class StaticDecoder:
    """Decode steps for one model: opens a :class:`DecodeSession` per answer.

    Args:
        adapter: the model (a ``ModelAdapter``).
        weights: ``"model"`` (the loaded weights), ``"int8"`` or ``"int4"`` (weight-only copies
            read by decode steps only, on the CPU; see ``ragkv.model.quant``).
    """

    def __init__(self, adapter: Any, weights: DecodeWeights = "model") -> None:
        if weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode weights must be one of {DECODE_WEIGHTS}, got {weights!r}")
        self.adapter = adapter
        self.weights = weights
        self.steer = Steer(kind="decode", weights=weights)
        adapter.model_for(weights)  # the quantized copy, made now

    def session(self, cache: Cache, num_tokens: int, max_new_tokens: int) -> DecodeSession:
        """A session continuing the prompt held in ``cache``'s first ``num_tokens`` slots.

        The prompt's K/V are copied once into buffers with room for ``max_new_tokens`` more; the
        given cache is left as it is.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return DecodeSession(self, cache, num_tokens, num_tokens + max_new_tokens)


class DecodeSession:
    """One answer's decode: :meth:`step` feeds a token and returns the next token's logits."""

    def __init__(self, decoder: StaticDecoder, cache: Cache, num_tokens: int, capacity: int) -> None:
        a = decoder.adapter
        self._decoder = decoder
        layers = []
        for layer in cache.layers:
            k, v = _layer_tensors(layer)  # [1, H, >= num_tokens, D]
            if k.shape[2] < num_tokens:
                raise ValueError(f"the cache holds {k.shape[2]} slots, fewer than the prompt's {num_tokens}")
            keys = k.new_empty((1, k.shape[1], capacity, k.shape[3]))  # [1, H, capacity, D]
            values = v.new_empty((1, v.shape[1], capacity, v.shape[3]))
            keys[:, :, :num_tokens] = k[:, :, :num_tokens]
            values[:, :, :num_tokens] = v[:, :, :num_tokens]
            layers.append(_SlotLayer(keys, values))
        self._slots = layers
        self._cache = _SlotCache(layers)
        self.length = num_tokens  # slots filled: the next token goes at this position
        self.capacity = capacity
        positions = torch.arange(num_tokens, capacity, device=a.device)  # [new]
        self._pos = positions.reshape(1, -1)  # [1, new]
        like = torch.zeros(1, dtype=a.dtype, device=a.device)
        self._cos, self._sin = a.position_embeddings(positions, like)  # [1, new, rot_dim] each
        self._start = num_tokens
        self._set_length(num_tokens)

    def _set_length(self, n: int) -> None:
        for layer in self._slots:
            layer.length = n
        self.length = n

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed ``token`` at position :attr:`length`; return fp32 logits ``[vocab]`` of the next token."""
        n = self.length
        if n >= self.capacity:
            raise ValueError(f"the session holds {self.capacity} tokens; open it with a larger max_new_tokens")
        i = n - self._start
        logits = self._layers_and_head(token, self._pos[:, i : i + 1], self._cos[:, i : i + 1], self._sin[:, i : i + 1])
        self._set_length(n + 1)
        return logits

    def _layers_and_head(self, token: int, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The model's own layers for one token (pos ``[1, 1]``, cos/sin ``[1, 1, rot_dim]``); logits ``[vocab]``."""
        d = self._decoder
        hidden = d.adapter.embed(torch.tensor([token]))  # [1, 1, hidden]
        # no mask: the one query sees every slot written so far (ArchSpec caps contexts at any sliding window)
        hidden = d.adapter.run_layers(hidden, pos, self._cache, (cos, sin), None, d.steer)
        return d.adapter.final_logits(hidden, d.weights)[0, -1]  # [vocab]

    def steps(self, tokens: Iterator[int]) -> Iterator[torch.Tensor]:
        """Logits after each of ``tokens`` (teacher forcing: for measuring a weight format's error)."""
        for tok in tokens:
            yield self.step(tok)
