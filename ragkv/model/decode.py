"""The decode step at the memory limit: a static KV cache, fp32 one-query attention, optional int8 weights.

gpt-fast's recipe on the model's own layers: the prompt's K/V are copied once into buffers sized
for the whole answer, so a step writes one column in place (a ``DynamicCache`` concatenates, a
copy of every layer per token); a step calls the decoder layers directly (no mask to build: one
query sees every slot written so far) with rotary tables computed once per answer; attention of
the single query runs in fp32 (see ``ragkv.model.attention.decode_step``). With
``weights="int8"`` the linear layers and the LM head read per-channel int8 copies of their
weights during decode steps (prefill and fusion keep the model's weights), halving the bytes a
bf16 step streams: a lossy setting, named in the stats, never a default.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal, get_args

import torch
from torch import nn
from transformers.cache_utils import Cache

from ragkv.model.attention import decode_step
from ragkv.model.batch import _SlotCache, _SlotLayer
from ragkv.model.caches import _layer_tensors, cache_kwarg

logger = logging.getLogger(__name__)

__all__ = ["DECODE_WEIGHTS", "DecodeSession", "DecodeWeights", "StaticDecoder", "quantize_int8"]

DecodeWeights = Literal["model", "int8"]
DECODE_WEIGHTS: tuple[str, ...] = get_args(DecodeWeights)
# set inside the steps of an int8 decoder only: a model-weights decoder on the same model reads the model's weights
_INT8_STEP: ContextVar[bool] = ContextVar("ragkv_int8_step", default=False)
_INT8_ALIGN = 16  # in_features the int8 kernel handles: multiples of 16 (24 gave wrong sums, 13 a segfault)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` ``[out, in]``: ``(int8 [out, in], scales [out])``.

    ``weight[o] ~= q[o] * scales[o]``, with ``scales[o] = max|weight[o]| / 127`` (a zero row gets 1).
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    scales = torch.where(w.abs().amax(dim=1) > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(scale_dtype)


def _int8_forward(module: nn.Linear, q: torch.Tensor, scales: torch.Tensor, act: torch.dtype) -> Callable[..., Any]:
    """``module.forward``, reading the int8 copy ``q`` ``[out, in]`` inside an int8 decoder's steps."""
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _INT8_STEP.get():
            return plain(x)
        flat = x.reshape(-1, x.shape[-1]).to(act)  # [rows, in]: the kernel takes 2-D activations
        out = torch._weight_int8pack_mm(flat, q, scales).to(x.dtype)  # [rows, out]
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


_INT8_INSTALLED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # module -> bytes added


def _install_int8(model: Any) -> int:
    """Give every linear layer of the decoder and the LM head an int8 copy (once); return the bytes added.

    The modules stay where they are (state dict, fingerprint and prefill untouched): only their
    ``forward`` changes, to read the copy inside int8 decode steps. On the CPU the kernel is fast for
    bf16 activations and slow for fp32 ones, so an fp32 model's activations go through it in bf16.
    """
    act = torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    added = 0
    for module in [*model.model.layers.modules(), model.lm_head]:
        if not isinstance(module, nn.Linear) or module in _INT8_INSTALLED:
            continue
        if module.in_features % _INT8_ALIGN:  # torch 2.13's CPU kernel misreads (or crashes on) other widths
            logger.warning(
                "int8 decode: %s keeps its weights (in_features %d)", type(module).__name__, module.in_features
            )
            continue
        q, scales = quantize_int8(module.weight, act)
        module.forward = _int8_forward(module, q, scales, act)  # type: ignore[method-assign]
        _INT8_INSTALLED[module] = q.numel() + scales.numel() * scales.element_size()
        added += _INT8_INSTALLED[module]
    return added


class StaticDecoder:
    """Decode steps for one model: opens a :class:`DecodeSession` per answer.

    Args:
        adapter: the model (a ``ModelAdapter``).
        weights: ``"model"`` (the loaded weights) or ``"int8"`` (weight-only int8 copies, per
            output channel, used by decode steps only).
    """

    def __init__(self, adapter: Any, weights: DecodeWeights = "model") -> None:
        if weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode weights must be one of {DECODE_WEIGHTS}, got {weights!r}")
        self.adapter = adapter
        self.weights = weights
        inner = adapter.model.model
        self._layers = list(inner.layers)
        self._cache_kw = cache_kwarg(type(self._layers[0]))
        if weights == "int8":
            added = _install_int8(adapter.model)
            logger.info("int8 decode weights for %s: %.0f MB added", adapter.name, added / 1e6)

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

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed ``token`` at position :attr:`length`; return fp32 logits ``[vocab]`` of the next token."""
        n = self.length
        if n >= self.capacity:
            raise ValueError(f"the session holds {self.capacity} tokens; open it with a larger max_new_tokens")
        i = n - self._start
        int8 = _INT8_STEP.set(self._decoder.weights == "int8")
        try:
            with decode_step():
                logits = self._layers_and_head(
                    token, self._pos[:, i : i + 1], self._cos[:, i : i + 1], self._sin[:, i : i + 1]
                )
        finally:
            _INT8_STEP.reset(int8)
        self._set_length(n + 1)
        return logits

    def _layers_and_head(self, token: int, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The model's own layers for one token (pos ``[1, 1]``, cos/sin ``[1, 1, rot_dim]``); logits ``[vocab]``."""
        d = self._decoder
        kw = {d._cache_kw: self._cache}
        hidden = d.adapter.embed(torch.tensor([token]))  # [1, 1, hidden]
        for layer in d._layers:
            # no mask: the one query sees every slot written so far (ArchSpec caps contexts at any sliding window)
            out = layer(
                hidden, attention_mask=None, position_ids=pos, use_cache=True, position_embeddings=(cos, sin), **kw
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return d.adapter.final_logits(hidden)[0, -1]  # [vocab]

    def steps(self, tokens: Iterator[int]) -> Iterator[torch.Tensor]:
        """Logits after each of ``tokens`` (teacher forcing: for measuring a weight format's error)."""
        for tok in tokens:
            yield self.step(tok)
