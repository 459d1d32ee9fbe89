"""ragkv's registered attention function: what a call does is read from the pass's :class:`Steer`.

The probe used to switch ``model.config._attn_implementation`` for the length of a block. Every
thread's forward reads that one config, so a concurrent answer ran in the slow probe mode, and a
racing thread could restore the wrong value and leave the model there (or switch a probing thread
back mid-pass, whose probe then missed layers: the KeyError of issue 9). Now the model is switched
once, when its adapter is made, to a dispatcher registered for the implementation it was loaded
with (``ragkv_sdpa`` delegates to ``sdpa``). What one call does (record the weights, run a decode
step's one query in fp32, split off decode rows riding on a prefill piece, compute a fused pass's
scattered queries from their positions with ragkv's CPU kernel) is an argument of the
pass: a :class:`Steer` the decoder layers hand on to the attention function in their keyword
arguments (issue 32: it was read from three ContextVars, which no signature showed). One modeling
file (StableLM's decoder layer) calls its attention without handing its keyword arguments on; for
layers like it :func:`relay_steer` adds a hook pair that carries the layer call's ``ragkv_steer``
across that one call (the only ContextVar left, set and cleared by the layer call it spans).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import CausalBias
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ragkv.model.masks import PositionMask
from ragkv.model.native_attention import scatter_applies, scatter_attention

__all__ = [
    "DECODE_WEIGHTS",
    "PLAIN",
    "STEER_KWARG",
    "AttentionProbe",
    "Carry",
    "DecodeWeights",
    "Steer",
    "StepKind",
    "fused_pass_attention",
    "install_dispatcher",
    "is_dispatched",
    "relay_steer",
]

_PREFIX = "ragkv_"  # dispatcher names: _PREFIX + the implementation delegated to
_REGISTER_LOCK = threading.Lock()
_RELAYED: ContextVar[Steer | None] = ContextVar("ragkv_relayed_steer", default=None)  # see relay_steer
StepKind = Literal["prefill", "decode"]
DecodeWeights = Literal["model", "int8", "int4", "fp16"]  # what decode steps read (ragkv.model.quant)
DECODE_WEIGHTS: tuple[str, ...] = get_args(DecodeWeights)


class AttentionProbe:
    """Records the attention weights of the passes steered with it (``Steer(probe=...)``), in fp32."""

    def __init__(self, layer_idx: int | None) -> None:
        self.layer_idx = layer_idx  # None: every layer
        self.weights: dict[int, torch.Tensor] = {}  # layer -> [kv_len], summed over heads and queries


# (products [1, kv_heads, rows, slots] in the model's dtype, scale, mask) -> the fp32 scaled and masked
# scores, bit for bit ``products.float() * scale + mask``; None where it does not take the call
ScaleMask = Callable[[torch.Tensor, float, Any], "torch.Tensor | None"]


def _probe_attention(
    probe: AttentionProbe,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    scale_mask: ScaleMask | None = None,
) -> tuple[torch.Tensor, None]:
    """Eager attention that also records the probabilities in ``probe`` (softmax in fp32).

    Grouped-query heads are computed per KV head (the query heads of a group stacked as rows), so
    K and V are never repeated per query head: at 16K tokens of an 8B model that was ~1 GB of
    copies per layer, most of the probe's time on a GPU. On a GPU with a half-precision model the
    two products run in the model's dtype, as transformers' eager attention computes them (tensor
    cores; in fp32 they were 41 of the probe's 43 ms of device time at 16K on an H100); elsewhere
    in fp32. ``scale_mask`` (a GPU's one-pass kernel, ``ragkv.gpu.kernels.scale_mask``) turns the
    half-precision products into the scaled, masked fp32 scores where it takes the call: the same
    numbers as the three passes below.
    """
    # query: [1, Hq, q, D]; key/value: [1, Hkv, kv, D]; query head h reads KV head h // groups
    b, hq, q_len, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    half = _half_products(query)
    grouped = query.reshape(b, hkv, hq // hkv * q_len, d)  # [1, Hkv, groups * q, D]
    k, v = (key, value) if half else (key.float(), value.float())
    grouped = grouped if half else grouped.float()
    scale = scaling if scaling is not None else d**-0.5
    products = grouped @ k.transpose(-1, -2)  # [1, Hkv, groups * q, kv]
    # a mask of one row or of every query's (shared by the heads): what the kernel's row mapping computes
    whole_rows = isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-2] in (1, q_len)
    fused = scale_mask(products, scale, attention_mask) if scale_mask is not None and half and whole_rows else None
    if fused is not None:  # scaled and masked in one pass
        scores = fused.view(b, hq, q_len, kv_len)
    else:
        scores = _masked((products.float() * scale).view(b, hq, q_len, kv_len), attention_mask)  # [1, Hq, q, kv]
    probs = scores.softmax(dim=-1)
    probe.weights[layer] = probs.sum(dim=(0, 1, 2))
    out = (probs.view(b, hkv, -1, kv_len).to(v.dtype) @ v).view(b, hq, q_len, d)  # [1, Hq, q, D]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _masked(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The probe's fp32 scores ``[1, Hq, q, kv]`` with ``attention_mask`` applied: a bool mask (True = may
    attend, SDPA's convention), an additive one, or none (or SDPA's lower-right causal bias), where
    the ``q`` queries are the last ``q`` of the ``kv`` slots, each seeing the slots up to its own:
    SDPA's mask builder returns None where it would use is_causal, and fusion passes that bias."""
    if isinstance(attention_mask, CausalBias):
        attention_mask = None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, float("-inf"))
    if attention_mask is not None:
        return scores + attention_mask.float()
    q_len, kv_len = scores.shape[2], scores.shape[3]
    if q_len == 1:
        return scores
    rows = torch.arange(kv_len - q_len, kv_len, device=scores.device).unsqueeze(1)
    return scores.masked_fill(torch.arange(kv_len, device=scores.device) > rows, float("-inf"))


def _half_products(query: torch.Tensor) -> bool:
    """True where the probe's two products run in the model's half-precision dtype (a GPU's tensor cores)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def _one_query_fp32(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """Attention of one query per row over every cached slot the mask allows, computed in fp32.

    On the CPU, torch's bf16 SDPA for a single query is ~7x slower than fp32 (1.21 vs 0.16 ms over
    1.5K keys; 29 ms of a 100 ms Qwen 0.5B step), and repeating K/V for GQA costs a copy: the query
    heads that share a KV head are laid out as that head's rows instead.
    """
    # query: [B, Hq, 1, D]; key/value: [B, Hkv, S, D]; mask: None, or [B or 1, 1, 1, S] (additive or bool)
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]: query head h reads KV head h // G
    scale = scaling if scaling is not None else d**-0.5
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, S]
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask[..., -1:, :]  # [B or 1, 1, 1, S]: broadcasts over the KV heads and groups
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    out = torch.matmul(scores.softmax(dim=-1), value.float())  # [B, Hkv, G, D]
    return out.to(query.dtype).reshape(b, 1, hq, d), None  # [B, 1, Hq, D], as the delegated functions return


@dataclass(frozen=True, slots=True)
class Carry:
    """Decode rows riding on a prefill piece's pass (set by ``ragkv.model.batch.DecodeBatch.carried_step``).

    The pass's first ``piece`` queries attend as the model's implementation would, over the key/value
    the layer passes; the rest are decode rows, one query each over its own slot, in fp32 as a decode step.
    """

    piece: int  # the prefill piece's queries (the first ones of the pass)
    rows_mask: torch.Tensor  # [B, 1, 1, span]: each row's own columns
    row_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> the rows' K/V [B, kv_heads, span, head_dim]


@dataclass(frozen=True, slots=True)
class Steer:
    """What one forward pass does besides running the model as loaded: the argument every pass takes.

    ``ModelAdapter.forward``/``run_layer``/``run_layers`` take it and hand it to each attention call
    through transformers' keyword arguments (``ragkv_steer``: the decoder layers pass their
    ``**kwargs`` on to the attention function, where ragkv's dispatcher reads it); the adapter reads
    ``weights`` itself (which linear layers the pass runs). :data:`PLAIN` steers nothing: every
    call delegates to the loaded implementation exactly.
    """

    kind: StepKind = "prefill"  # "decode": one query per row; on the CPU its attention runs in fp32
    weights: DecodeWeights = "model"  # the linear layers read the model's weights or an int8/int4/fp16 copy
    probe: AttentionProbe | None = None  # records the attention weights of the pass's queries
    carry: Carry | None = None  # decode rows riding on the pass's last queries
    # [q] int64 on the host: the slots of the pass's queries, each of which sees the slots up to its
    # own (the pass's mask is ModelAdapter.causal_mask of them). On a CPU (AVX512-BF16 for bf16, AVX2
    # for fp32) the calls ragkv's kernel computes as asked run there from these positions
    # (ragkv.model.native_attention); the others take the mask as before
    query_pos: torch.Tensor | None = None

    @property
    def plain_attention(self) -> bool:
        """Whether every attention call of the pass delegates to the loaded implementation as is."""
        return self.kind == "prefill" and self.probe is None and self.carry is None and self.query_pos is None


PLAIN = Steer()
STEER_KWARG = "ragkv_steer"  # the keyword the dispatcher reads the pass's Steer from


def _carried_attention(
    carry: Carry,
    base: str,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The piece's queries through the delegated implementation, the rows' through the fp32 one-query path."""
    # query: [1, Hq, p + B, D]; key/value: the piece's cache [1, Hkv, start + p, D]
    p = carry.piece
    piece, _ = _delegate(base, module)(module, query[:, :, :p], key, value, attention_mask, *args, **kwargs)
    row_k, row_v = carry.row_kv(module.layer_idx)
    b, hq, d = query.shape[2] - p, query.shape[1], query.shape[3]
    row_q = query[0, :, p:].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
    if _takes_fp32_decode(row_q, kwargs):  # as a step of its own would (Steer(kind="decode")'s choice)
        rows, _ = _one_query_fp32(row_q, row_k, row_v, carry.rows_mask, kwargs.get("scaling"))  # [B, 1, Hq, D]
    else:
        rows, _ = _delegate(base, module)(module, row_q, row_k, row_v, carry.rows_mask, *args, **kwargs)
    return torch.cat([piece, rows.reshape(1, b, hq, d)], dim=1), None  # [1, p + B, Hq, D]


def _takes_fp32_decode(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a call inside a decode step is one the fp32 one-query path computes exactly as asked."""
    if query.shape[2] != 1 or query.device.type != "cpu":
        return False  # CUDA's SDPA kernels are fast for one query; several queries are a prefill
    return not kwargs.get("softcap") and not kwargs.get("dropout") and kwargs.get("s_aux") is None


def _native_takes(
    steer: Steer, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]
) -> bool:
    """Whether ragkv's CPU kernel computes this call exactly as asked (a pass with query positions)."""
    if steer.query_pos is None or not getattr(module, "is_causal", True):
        return False
    return scatter_applies(query, key, value, kwargs)


def _blocks_apply(
    base: str,
    steer: Steer,
    mask: PositionMask,
    query: torch.Tensor,
    key: torch.Tensor,
    kwargs: dict[str, Any],
    grouped: bool = False,
) -> bool:
    """Whether a call with ``mask`` runs through :func:`_blocked_attention`: by blocks of rows
    (:meth:`PositionMask.blocks`) where the mask is too large to make whole, or whole through SDPA
    where query heads share key heads (``grouped``: transformers' SDPA call would repeat the keys
    and values of several rows, since it has a mask; on a CPU or CUDA). Only a call the delegated
    SDPA or eager function would compute plainly (no dropout, soft-capping, window, sinks or
    per-query bias), for the rows and slots the mask was made for."""
    # grouped heads taken whole only for several rows on a CPU or CUDA: one row transformers packs
    # into the key heads itself (no copy), and elsewhere (MPS) torch's choice of kernel is not asked
    whole = grouped and base == "sdpa" and query.shape[2] > 1 and query.device.type in ("cpu", "cuda")
    if not (mask.blocked or whole) or base not in ("sdpa", "eager"):
        return False
    return _plain_call(steer, mask, query, key, kwargs)


def _plain_call(
    steer: Steer, mask: PositionMask, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]
) -> bool:
    """Whether a call with ``mask`` is plain attention over it: a prefill pass's (no probe, no decode rows
    riding along), no dropout, soft-capping, window, sinks or per-query bias, for the rows and slots
    the mask was made for. What may run by blocks of rows, or through the mask's kernel."""
    if steer.probe or steer.carry or steer.kind != "prefill":
        return False
    if kwargs.get("dropout") or kwargs.get("softcap") or kwargs.get("sliding_window") is not None:
        return False
    if any(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k != "position_ids") or kwargs.get("s_aux"):
        return False  # a bias or sinks per query and slot: cut by blocks, it would need cutting too
    return query.shape[0] == 1 and query.shape[2] == mask.rows and key.shape[2] == mask.num_keys


def fused_pass_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: PositionMask, scale: float | None = None
) -> torch.Tensor:
    """What a fused pass's plain SDPA call over ``mask`` computes through torch, ``[1, q, Hq, D]``: by blocks
    of rows where the mask is large, else the whole mask; key and value heads shared by their query
    heads where torch has a fused kernel for it, else repeated (:func:`_blocked_attention`). The
    reference and the baseline of a kernel taking such calls (``ragkv.gpu.attention``)."""
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1])
    return _blocked_attention("sdpa", module, query, key, value, mask, (), {"scaling": scale})[0]


def _blocked_attention(
    base: str,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: PositionMask,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """The call over ``mask``'s blocks of rows, each over the slots up to its last row's (one block, the
    whole mask, where it is small enough to make whole): ``[1, q, heads, D]``.

    SDPA is called as transformers' ``sdpa_attention_forward`` calls it with a mask (not causal), the
    query heads of a group sharing their key and value head (``enable_gqa``) where a fused kernel
    computes it so (:func:`_shares_heads`), else with the key and value repeated to the query heads,
    as transformers does with a mask, the repetition made once for every block (through the
    delegated function each block would repeat them again). Other calls go to the delegated
    function block by block.
    """
    outs = []
    groups = int(getattr(module, "num_key_value_groups", 1))
    # a small mask is made whole once and kept (every layer shares it): one block over every slot
    blocks = mask.blocks() if mask.blocked else iter([(0, mask.rows, mask.num_keys, mask.dense())])
    if base == "sdpa" and not args and query.shape[1] == key.shape[1] * groups:
        last = max(cut for _, _, cut in mask.spans()) if mask.blocked else mask.num_keys
        key, value = key[:, :, :last], value[:, :, :last]
        scale = kwargs.get("scaling")
        repeated: tuple[torch.Tensor, torch.Tensor] | None = None  # made the first time a block needs it
        for start, end, cut, block in blocks:
            q, k, v = query[:, :, start:end], key[:, :, :cut], value[:, :, :cut]
            if groups > 1 and _shares_heads(q, k, v, block, scale):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=block, scale=scale, enable_gqa=True)
            else:
                if groups > 1 and repeated is None:
                    repeated = repeat_kv(key, groups), repeat_kv(value, groups)
                if repeated is not None:
                    k, v = repeated[0][:, :, :cut], repeated[1][:, :, :cut]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=block, scale=scale)
            outs.append(out.transpose(1, 2))  # [1, rows, heads, D]
            del block, out  # one block's mask alive at a time
        return torch.cat(outs, dim=1), None
    fn, position_ids = _delegate(base, module), kwargs.get("position_ids")
    for start, end, cut, block in blocks:
        if isinstance(position_ids, torch.Tensor) and position_ids.shape[-1] == mask.rows:
            kwargs = {**kwargs, "position_ids": position_ids[..., start:end]}
        out, _ = fn(module, query[:, :, start:end], key[:, :, :cut], value[:, :, :cut], block, *args, **kwargs)
        outs.append(out)  # [1, rows, heads, D]
        del block, out
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _shares_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> bool:
    """Whether SDPA computes this masked call with each key and value head shared by its query heads
    (``enable_gqa``) on a fused kernel, not the math one (which makes every head's scores whole).

    Repeating the keys and values to the query heads (what transformers does with a mask) copies
    them: at 16K tokens of Llama-3.1-8B's shape 268 MB a layer, 16 GB a fusion
    (``experiments/gpu_traffic.py``). torch's own choice of kernel for the call decides; False
    where it cannot say (a torch before ``enable_gqa``). On a CPU its flash kernel takes it, the
    output bit for bit the repeated call's.
    """
    try:
        choice = SDPBackend(torch._fused_sdp_choice(query, key, value, mask, 0.0, False, scale=scale, enable_gqa=True))
    except (AttributeError, TypeError, ValueError, RuntimeError):  # an older torch, or a kernel it does not name
        return False
    return choice not in (SDPBackend.MATH, SDPBackend.ERROR)


_EAGER: dict[type, Callable[..., Any]] = {}


def _delegate(base: str, module: Any) -> Callable[..., Any]:
    """The attention function ``base`` names for ``module`` (eager is the modeling file's own)."""
    if base != "eager":
        return ALL_ATTENTION_FUNCTIONS[base]
    fn = _EAGER.get(type(module))
    if fn is None:
        fn = sys.modules[type(module).__module__].eager_attention_forward
        _EAGER[type(module)] = fn
    return fn


def _dispatcher(base: str) -> Callable[..., Any]:
    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        steer: Steer = kwargs.pop(STEER_KWARG, None) or _RELAYED.get() or PLAIN
        native = _native_takes(steer, module, query, key, value, kwargs)  # ragkv's CPU kernel, from the positions
        if isinstance(attention_mask, PositionMask):  # a fused pass's mask, made here as the call needs it
            kernel = None if native or args else attention_mask.kernel  # a GPU's, from the positions: no mask
            if kernel is not None and _plain_call(steer, attention_mask, query, key, kwargs):
                out = kernel(query, key, value, attention_mask.device_positions(), kwargs.get("scaling"))
                if out is not None:
                    return out, None
            grouped = int(getattr(module, "num_key_value_groups", 1)) > 1
            if not native and _blocks_apply(base, steer, attention_mask, query, key, kwargs, grouped):
                return _blocked_attention(base, module, query, key, value, attention_mask, args, kwargs)
            if not native or steer.carry or steer.kind == "decode":
                attention_mask = attention_mask.dense()
        if steer.plain_attention:
            return _delegate(base, module)(module, query, key, value, attention_mask, *args, **kwargs)
        probe, carry = steer.probe, steer.carry
        layer = getattr(module, "layer_idx", None)
        if carry is not None and query.shape[2] > carry.piece:
            if layer is None:  # the rows' K/V are found by layer: without one they would read the piece's
                raise RuntimeError(f"{type(module).__name__} has no layer_idx; decode steps cannot ride on its passes")
            return _carried_attention(carry, base, module, query, key, value, attention_mask, *args, **kwargs)
        query_pos = steer.query_pos if native else None
        if probe is not None and layer is not None and probe.layer_idx in (None, layer):
            if query_pos is not None:  # the kernel sums the probabilities per slot as it goes
                weights = torch.empty(key.shape[2], dtype=torch.float32)
                out = scatter_attention(query, key, value, query_pos, kwargs.get("scaling"), weights)
                probe.weights[layer] = weights
                return out, None
            return _probe_attention(probe, layer, query, key, value, attention_mask, kwargs.get("scaling"))
        if steer.kind == "decode" and _takes_fp32_decode(query, kwargs):
            return _one_query_fp32(query, key, value, attention_mask, kwargs.get("scaling"))
        if query_pos is not None:
            return scatter_attention(query, key, value, query_pos, kwargs.get("scaling")), None
        return _delegate(base, module)(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__name__ = f"{_PREFIX}{base}"
    return attention


def install_dispatcher(model: Any) -> str:
    """Switch ``model`` (once) to ragkv's dispatcher for the attention it runs; return its name.

    Idempotent: a model already switched (a second adapter on it) keeps its dispatcher. Masks are
    built as for the delegated implementation.
    """
    cfg = model.config
    current = cfg._attn_implementation or "eager"
    if current.startswith(_PREFIX):
        return str(current)
    name = _PREFIX + current
    with _REGISTER_LOCK:
        if name not in ALL_ATTENTION_FUNCTIONS:
            if current != "eager" and current not in ALL_ATTENTION_FUNCTIONS:
                raise ValueError(f"attention implementation {current!r} is not registered with transformers")
            AttentionInterface.register(name, _dispatcher(current))
            if current in ALL_MASK_ATTENTION_FUNCTIONS:
                AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    cfg._attn_implementation = name
    return name


def is_dispatched(model: Any) -> bool:
    """Whether ``model`` runs ragkv's dispatcher (so a :class:`Steer` is heard)."""
    return str(model.config._attn_implementation or "").startswith(_PREFIX)


def _drops_kwargs(layer: Any) -> bool:
    """Whether ``layer``'s forward calls ``self.self_attn(...)`` without handing on its ``**kwargs``."""
    try:
        src = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return True
    start = src.find("self.self_attn(")
    if start < 0:
        return True
    depth, i = 1, start + len("self.self_attn(")
    while depth and i < len(src):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    return "**kwargs" not in src[start:i]


def relay_steer(model: Any) -> int:
    """Make ``model``'s decoder layers that drop their keyword arguments relay ``ragkv_steer`` to their
    attention (once per model); return how many layers needed it (StableLM's; none of the other families).

    A pre-hook takes the layer call's Steer and holds it for the call (a ContextVar: per thread and
    task), the hook after the call (run on errors too) clears it; the dispatcher reads it only when
    its own keyword arguments carry none. Hooks live in the module's hook dict, which the quantized
    decode copies (``ragkv.model.quant``) share.
    """
    relayed = 0
    for layer in model.model.layers:
        if getattr(layer, "_ragkv_relays", False) or not _drops_kwargs(layer):
            continue
        layer.register_forward_pre_hook(_hold_steer, with_kwargs=True)
        layer.register_forward_hook(_drop_steer, always_call=True)
        layer._ragkv_relays = True
        relayed += 1
    return relayed


def _hold_steer(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    _RELAYED.set(kwargs.pop(STEER_KWARG, None))
    return args, kwargs


def _drop_steer(module: Any, args: tuple[Any, ...], output: Any) -> None:
    _RELAYED.set(None)
