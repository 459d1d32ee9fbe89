"""Decode steps through the decoder layers without transformers' per-layer machinery, on the CPU.

A decode step of one token is a few hundred small tensor operations; on a CPU each costs
microseconds of Python and dispatch whatever its size. Through transformers' decoder layers a
Qwen2.5 0.5B step pays for keyword plumbing, the attention interface's lookup, the cache's
generic update and dtype round trips in every layer; on a 2-core AMD EPYC (int8 decode, 1,000
tokens of context) the median one-row step took 65 ms that way and 57 ms this way; with four rows
it did not gain (90 against 94 ms; ``experiments/decode_steps.py --lean``). :func:`lean_layers`
runs the same arithmetic with the layers' own weights and modules (norms, projections, the
activation) in the order the modeling files use, the rotary embedding written out (bitwise the
same products and sum as ``apply_rotary_pos_emb``), and the attention through ragkv's fp32
one-query path as the dispatcher would run it.

Only layers whose arithmetic is known are taken (:func:`lean_plan`): the Llama, Mistral, Qwen2 and
Qwen3 decoder layers with a gated SiLU MLP, no sliding window and standard rotary embeddings.
Any other model keeps transformers' layers; ``RAGKV_LEAN_DECODE=0`` keeps them for decode steps
(the layer parts fusion and :func:`kv_only_last_layer` use are not switched by it).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ragkv.model.attention import _one_query_fp32

__all__ = ["LeanLayer", "kv_only_last_layer", "layer_kv", "layer_parts", "lean_layers", "lean_plan"]

_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[LeanLayer, ...] | None] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class LeanLayer:
    """One decoder layer's parts, as its modeling file uses them."""

    index: int
    input_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None  # Qwen3: RMSNorm over each head's dims, before the rotation
    k_norm: nn.Module | None
    post_norm: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float


def _why_not(model: Any) -> str | None:
    """Why ``model``'s decoder layers cannot run lean (None: they can)."""
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r}"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "a sliding window"
    for layer in model.model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer).__name__ not in _LAYERS or attn is None or type(mlp).__name__ not in _MLPS:
            return f"layer {type(layer).__name__}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
        if any(type(n).__name__ not in _NORMS for n in norms):
            return "a norm of another kind"
        if getattr(attn, "sliding_window", None) is not None:
            return "a sliding window"
    return None


def lean_plan(model: Any) -> tuple[LeanLayer, ...] | None:
    """The lean layers of ``model`` (a loaded model or a decode copy of it), or None where they do not apply.

    Made once per model object; ``RAGKV_LEAN_DECODE=0`` turns the lean path off.
    """
    if os.environ.get("RAGKV_LEAN_DECODE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return layer_parts(model)


def layer_parts(model: Any) -> tuple[LeanLayer, ...] | None:
    """``model``'s decoder layers as their parts, or None where their arithmetic is not known here.

    Made once per model object. Decode steps run them whole (:func:`lean_layers`); fusion asks a layer
    for its keys and values alone (:func:`layer_kv`) for rows that need nothing else from it.
    """
    if model in _PLANS:
        return _PLANS[model]
    plan: tuple[LeanLayer, ...] | None = None
    if _why_not(model) is None:
        cfg = model.config
        plan = tuple(
            LeanLayer(
                index=i,
                input_norm=layer.input_layernorm,
                q_proj=layer.self_attn.q_proj,
                k_proj=layer.self_attn.k_proj,
                v_proj=layer.self_attn.v_proj,
                o_proj=layer.self_attn.o_proj,
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                post_norm=layer.post_attention_layernorm,
                gate_proj=layer.mlp.gate_proj,
                up_proj=layer.mlp.up_proj,
                down_proj=layer.mlp.down_proj,
                act=layer.mlp.act_fn,
                heads=cfg.num_attention_heads,
                kv_heads=cfg.num_key_value_heads,
                head_dim=layer.self_attn.head_dim,
                scaling=float(layer.self_attn.scaling),
            )
            for i, layer in enumerate(model.model.layers)
        )
    _PLANS[model] = plan
    return plan


def layer_kv(
    layer: LeanLayer, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value ``layer`` writes for ``hidden`` ``[1, q, hidden]``: ``[1, kv_heads, q, D]`` each.

    The operations of the layer's attention up to its cache update, in its order (input norm, the
    key and value projections, Qwen3's key norm, the rotation of the keys), and nothing after:
    no query, no attention, no MLP. ``position_embeddings``: cos/sin ``[1, q, D]`` at the rows' positions.
    For the same rows the result is bit for bit the layer's (tested); over other rows beside them a
    product may round its last bit otherwise, as any batch of another size may.
    """
    cos, sin, swap = _rotation(*position_embeddings)  # [1, q, 1, D]
    k, v = _rotated_kv(layer, _norm(layer.input_norm, hidden), hidden.shape[:2], cos, sin, swap)  # [1, q, H, D]
    return k.transpose(1, 2), v.transpose(1, 2)


class _LastLayerReached(Exception):  # noqa: N818  # control flow, never seen outside this module
    """Raised by the last layer's pre-hook in a pass that wants only its K/V: the layer's inputs."""

    def __init__(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__("the last decoder layer was reached")
        self.hidden, self.position_embeddings = hidden, position_embeddings


_CUT = threading.local()  # .layer: the layer module this thread's pass stops at (None: none)
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()


def _stop_here(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
    """The last layer's pre-hook: stop the pass of the thread that asked for it (no other thread's).

    A call it cannot read (no keyword arguments: torch registers a hook one step before it marks it
    as taking them; no ``position_embeddings``) runs the layer whole, as without the hook."""
    if getattr(_CUT, "layer", None) is not module or kwargs is None:
        return
    rope = kwargs.get("position_embeddings")
    hidden = args[0] if args else kwargs.get("hidden_states")
    if rope is None or hidden is None:
        _CUT.layer = None  # this pass runs whole
        return
    raise _LastLayerReached(hidden, rope)


def kv_only_last_layer(model: Any, run: Callable[[], object], cache: Any) -> bool:
    """Run ``run`` (a pass of ``model``'s decoder stack that only fills ``cache``: no output read) with
    its last layer cut to the K/V it writes.

    Nothing reads the last layer's output in such a pass (indexing a chunk, the prefix, a prefill
    piece before the last), yet transformers runs the whole layer: its attention and MLP over every
    row, 1/L of the pass. Here a pre-hook on the last layer stops the pass when it gets there, and
    the layer's K/V are written by :func:`layer_kv` for the same rows: bit for bit what the layer
    writes (tested). ``cache`` must append as transformers' ``DynamicCache`` does. The hook acts only
    on the thread that set it, so other threads' passes through the same model run whole.

    Returns whether the last layer was cut; False, having run ``run`` whole, where the layers are
    not known here (:func:`layer_parts`), where accelerate dispatches the layer (its hooks move
    tensors between devices), or where the layer was called in a way the hook cannot read.
    """
    parts = layer_parts(model)
    last: nn.Module = model.model.layers[-1]
    if not parts or hasattr(last, "_hf_hook"):
        run()
        return False
    with _HOOK_LOCK:
        if last not in _HOOKED:
            last.register_forward_pre_hook(_stop_here, with_kwargs=True)
            _HOOKED.add(last)
    outer = getattr(_CUT, "layer", None)  # a pass inside another's: restored after
    _CUT.layer = last
    try:
        run()
    except _LastLayerReached as stop:
        key, value = layer_kv(parts[-1], stop.hidden, stop.position_embeddings)
        cache.update(key, value, parts[-1].index)
        return True
    finally:
        _CUT.layer = outer
    return False


def _rotated_kv(
    layer: LeanLayer, x: torch.Tensor, rows: tuple[int, ...], cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s rotated key and its value for the normed rows ``x``, each ``[*rows, kv_heads, D]``."""
    k = layer.k_proj(x).view(*rows, layer.kv_heads, layer.head_dim)
    v = layer.v_proj(x).view(*rows, layer.kv_heads, layer.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: each head's dims normed before the rotation
        k = _norm(layer.k_norm, k)
    return _rotate(k, cos, sin, swap), v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor) -> torch.Tensor:
    """``x`` rotated as ``apply_rotary_pos_emb`` does, with :func:`_rotation`'s tables."""
    return x * cos + x.index_select(-1, swap) * sin


def _rotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cos, signed sin, swap)`` for ``x * cos + x[..., swap] * signed_sin``: ``rotate_half(x) * sin``
    is ``cat(-x2, x1) * sin``, the same products as ``cat(x2, x1) * cat(-sin1, sin2)`` (negation is exact)."""
    d = cos.shape[-1]
    half = d // 2
    # made where cos lives: a host tensor moved to a GPU would wait for the device (fusion runs this there)
    swap = torch.cat([torch.arange(half, d, device=cos.device), torch.arange(0, half, device=cos.device)])
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos.unsqueeze(2), signed.unsqueeze(2), swap  # [B, 1, 1, D]: broadcast over the heads


def lean_layers(
    plan: tuple[LeanLayer, ...],
    hidden: torch.Tensor,
    cache: Any,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Every decoder layer of a decode step: ``hidden`` ``[B, 1, hidden]`` -> ``[B, 1, hidden]``.

    ``cache`` takes each layer's new key/value through ``cache.update(k, v, layer)`` (``[B, kv_heads,
    1, D]``) and returns what the step's queries see; ``mask`` is None or ``[B, 1, 1, span]``, as for
    the dispatcher's one-query path.
    """
    cos, sin, swap = _rotation(*position_embeddings)
    b = hidden.shape[0]
    hidden = hidden.reshape(b, -1)  # [B, hidden]: the projections take 2-D rows as they are
    for layer in plan:
        x = _norm(layer.input_norm, hidden)
        q = layer.q_proj(x).view(b, 1, layer.heads, layer.head_dim)  # [B, 1, H, D]
        if layer.q_norm is not None and layer.k_norm is not None:
            q = _norm(layer.q_norm, q)
        q = _rotate(q, cos, sin, swap)
        k, v = _rotated_kv(layer, x, (b, 1), cos, sin, swap)
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer.index)
        out, _ = _one_query_fp32(q.transpose(1, 2), keys, values, mask, layer.scaling)  # [B, 1, H, D]
        hidden = hidden + layer.o_proj(out.reshape(b, -1))
        x = _norm(layer.post_norm, hidden)
        hidden = hidden + layer.down_proj(layer.act(layer.gate_proj(x)) * layer.up_proj(x))
    return hidden.unsqueeze(1)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; in fp32 on the CPU through ``torch.nn.functional.rms_norm``, one call for the
    module's eight operations (the same values there: tested bit for bit against the module). On a
    GPU the module itself: its fused kernel may sum in another order, and no GPU test has shown it
    does not."""
    weight: torch.Tensor = norm.weight  # type: ignore[assignment]
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return torch.nn.functional.rms_norm(x, weight.shape, weight, float(norm.variance_epsilon))  # type: ignore[arg-type]
    return norm(x)
