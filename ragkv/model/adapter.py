"""ModelAdapter: a loaded causal LM and its tokenizer, with the operations ragkv needs."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ragkv.digests import sha256_hex
from ragkv.errors import ContextTooLongError
from ragkv.model import caches
from ragkv.model.arch import ArchSpec
from ragkv.model.attention import (
    PLAIN,
    STEER_KWARG,
    AttentionProbe,
    DecodeWeights,
    Steer,
    install_dispatcher,
    is_dispatched,
    relay_steer,
)
from ragkv.model.caches import ScatterCache, cache_kwarg, concat_kv
from ragkv.model.lean import kv_only_last_layer, layer_kv, layer_parts, lean_layers, lean_plan
from ragkv.model.masks import PositionKernel, PositionMask, causal_mask_at
from ragkv.model.native_attention import attention_available
from ragkv.model.quant import quantized
from ragkv.model.rotary import RotaryFn, model_rotary_fn, move_keys
from ragkv.model.support import rotated_layers
from ragkv.prompt import DEFAULT_SYSTEM, PromptLayout
from ragkv.types import ChunkKV, LogitsWanted

if TYPE_CHECKING:
    from ragkv.model.batch import Rider

logger = logging.getLogger(__name__)

__all__ = ["ModelAdapter", "load_model"]

_LOGITS_WANTED = get_args(LogitsWanted)


def _is_tail(query_pos: torch.Tensor, num_keys: int) -> bool:
    """Whether host positions ``query_pos`` are exactly the last ``len(query_pos)`` of ``num_keys`` slots."""
    q = int(query_pos.numel())
    if query_pos.device.type != "cpu" or not 0 < q <= num_keys:
        return False  # a device tensor would cost a sync to read: take the general mask
    return bool(torch.equal(query_pos.to(torch.long), torch.arange(num_keys - q, num_keys)))


class ModelAdapter:
    """A loaded causal LM and its tokenizer, with the operations ragkv needs.

    Making an adapter switches the model's attention, once, to ragkv's dispatcher (which delegates
    to the implementation the model was loaded with; see ``ragkv.model.attention``).

    Args:
        model: a transformers causal LM of a supported (Llama-like) family.
        tokenizer: its tokenizer.
        name: a display name (the alias or path it was loaded from).
    """

    def __init__(self, model: Any, tokenizer: Any, name: str = "") -> None:
        self.spec = ArchSpec.from_model(model)
        self.model = model.eval()
        install_dispatcher(self.model)
        relay_steer(self.model)  # layers that drop their kwargs (StableLM's) still hand the Steer on
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or self.spec.model_type
        self._inner = model.model
        self._fingerprint: str | None = None
        self.dtype_reason = "given"  # why the weights run in their dtype (load_model says, e.g. "auto: ...")
        self.weight_bits: int | None = None  # bits a weight value is stored in, in its GGUF file (None: not GGUF)
        self._tok_fingerprint: str | None = None
        self._number_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._eos: frozenset[int] | None = None
        self._layouts: dict[str, PromptLayout] = {}
        self._rotary_fn: RotaryFn | None = model_rotary_fn(model)
        # [layers] bool: layers that apply RoPE; the probe refuses models whose caches cannot be moved
        self.rotated_layers = rotated_layers(self, self._rotary_fn)

    # ---- identity -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def fingerprint(self) -> str:
        """Digest of architecture and weights (a strided sample of every tensor: cheap, still weight-specific)."""
        if self._fingerprint is None:
            h = hashlib.sha256(json.dumps(self.spec_dict(), sort_keys=True).encode())
            for name, p in sorted(self.model.state_dict().items()):
                flat = p.detach().reshape(-1)
                step = max(1, flat.numel() // 4096)
                h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
                h.update(flat[::step].float().cpu().numpy().tobytes())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    @property
    def tokenizer_fingerprint(self) -> str:
        """Digest of the vocabulary and special tokens."""
        if self._tok_fingerprint is None:
            vocab = sorted(self.tokenizer.get_vocab().items())
            special = sorted(str(t) for t in self.tokenizer.all_special_tokens)
            blob = json.dumps([type(self.tokenizer).__name__, vocab, special], ensure_ascii=False)
            self._tok_fingerprint = sha256_hex(blob.encode())[:32]
        return self._tok_fingerprint

    def spec_dict(self) -> dict[str, Any]:
        return {k: getattr(self.spec, k) for k in self.spec.__dataclass_fields__}

    # ---- tokens -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` on its own, no special tokens added (special tokens in the text are parsed)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def number_runs(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids)]`` id of the number each token belongs to, -1 for tokens of no number.

        A number is a run of tokens that hold a digit, with single ``,`` ``.`` ``:`` tokens between
        two of them joined in ("4,412", "3.5", "03:40"); separated by anything else, two numbers
        are two runs. Ids count from 0 in order.
        """
        digit, sep = self._number_table()
        ids = ids.cpu().long()
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        inside = (ids >= 0) & (ids < digit.numel())
        safe = torch.where(inside, ids, 0)
        num = digit[safe] & inside
        mid = sep[safe] & inside
        prev_num = torch.cat([torch.zeros(1, dtype=torch.bool), num[:-1]])
        next_num = torch.cat([num[1:], torch.zeros(1, dtype=torch.bool)])
        member = num | (mid & prev_num & next_num)
        prev_member = torch.cat([torch.zeros(1, dtype=torch.bool), member[:-1]])
        run = torch.cumsum((member & ~prev_member).long(), 0) - 1
        return torch.where(member, run, -1)

    def _number_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[vocab]`` bools: the token holds a digit; the token is one separator (built once)."""
        if self._number_tables is None:
            tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            texts = [self.tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]
            digit = torch.tensor([any(c.isdigit() for c in t) for t in texts], dtype=torch.bool)
            sep = torch.tensor([t in (",", ".", ":") for t in texts], dtype=torch.bool)
            self._number_tables = (digit, sep)
        return self._number_tables

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end an answer (read once: the server's scheduler asks for every token of every row,
        and ``get_vocab()`` builds the tokenizer's whole vocabulary dict on each call)."""
        if self._eos is None:
            ids: set[int] = set()
            for src in (self.model.generation_config, self.model.config, self.tokenizer):
                e = getattr(src, "eos_token_id", None)
                ids.update(e if isinstance(e, list | tuple | set) else ([] if e is None else [e]))
            if "<|im_end|>" in self.tokenizer.get_vocab():
                ids.add(int(self.tokenizer.convert_tokens_to_ids("<|im_end|>")))
            self._eos = frozenset(int(i) for i in ids)
        return self._eos

    def layout(self, system: str | None = None) -> PromptLayout:
        """The prompt layout for ``system`` (cached per system prompt)."""
        key = system or DEFAULT_SYSTEM
        if key not in self._layouts:
            self._layouts[key] = PromptLayout.from_tokenizer(self.tokenizer, key)
        return self._layouts[key]

    def chat_segments(
        self, system: str | None, chunks: Sequence[str], question: str
    ) -> tuple[list[int], list[list[int]], list[int]]:
        """Token ids of a RAG prompt, segment by segment: (prefix, one list per chunk, suffix)."""
        lay = self.layout(system)
        return (
            self.encode(lay.prefix),
            [self.encode(lay.chunk_text(c)) for c in chunks],
            self.encode(lay.suffix_text(question)),
        )

    def check_context(self, total_tokens: int) -> None:
        if total_tokens > self.spec.max_context:
            raise ContextTooLongError(
                f"prompt needs {total_tokens} tokens but {self.name} has a {self.spec.max_context}-token context; "
                "retrieve fewer chunks (lower top_k), ask a shorter question or lower max_new_tokens"
            )

    # ---- positions --------------------------------------------------------------------------
    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own cos/sin at ``positions`` ([T] int64), in fp32: ``[1, T, rot_dim]`` each."""
        dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        pos = positions.to(self.device, non_blocking=True).reshape(1, -1)
        with torch.no_grad():
            cos, sin = self._inner.rotary_emb(dummy, pos)
        return cos.float(), sin.float()

    @property
    def rotary_fn(self) -> RotaryFn | None:
        """The model's own rotation ``(x, cos, sin) -> x`` (None: plain half-split), as :meth:`rerotate` uses."""
        return self._rotary_fn

    def rerotate(self, kv: ChunkKV, target_positions: torch.Tensor | int) -> ChunkKV:
        """Move cached keys from their stored positions to ``target_positions`` (or a start offset).

        Undoes the rotation at the stored positions and applies it at the targets, both with the
        model's own rotary module and its own rotation function, so every RoPE variant and layout it
        implements (scaled, interleaved, partial) is handled; layers without RoPE keep their keys.
        Computed in fp32 (see :func:`ragkv.model.rotary.move_keys`).
        """
        if isinstance(target_positions, int):
            target = torch.arange(target_positions, target_positions + kv.num_tokens, dtype=torch.long)
        else:
            target = target_positions.to(torch.long).reshape(-1)
        if target.shape[0] != kv.num_tokens:
            raise ValueError(f"need {kv.num_tokens} target positions, got {target.shape[0]}")
        if torch.equal(target.cpu(), kv.positions.cpu()):
            return kv
        cos_p, sin_p = self.rotary(kv.positions)  # [1, T, R]
        cos_q, sin_q = self.rotary(target)
        keys = kv.keys.to(device=self.device)
        moved = move_keys(keys, cos_p, sin_p, cos_q, sin_q, self._rotary_fn, self.rotated_layers)  # [L, H, T, D] fp32
        return ChunkKV(
            keys=moved.to(kv.keys.dtype),
            values=kv.values,
            positions=target.to(kv.positions.device),
            model_fingerprint=kv.model_fingerprint,
        )

    # ---- caches -----------------------------------------------------------------------------
    def _check_kv(self, kv: ChunkKV) -> None:
        s = self.spec
        want = (s.num_layers, s.num_kv_heads, s.head_dim)
        got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        if got != want:
            raise ValueError(f"ChunkKV shape (layers, kv_heads, head_dim)={got} does not fit this model's {want}")

    def build_cache(self, context: Sequence[ChunkKV]) -> DynamicCache:
        """A transformers DynamicCache holding ``context`` in order (positions must run 0..N-1)."""
        if not context:
            return DynamicCache(config=self.model.config)
        kv = concat_kv(list(context))
        self._check_kv(kv)
        if not torch.equal(kv.positions.cpu(), torch.arange(kv.num_tokens)):
            raise ValueError("context caches must sit at positions 0..N-1 in order; rerotate() them first")
        # concat_kv made new tensors (torch.cat copies even one part): the cache may hold them as they are
        keys = kv.keys.to(device=self.device, dtype=self.dtype)
        values = kv.values.to(device=self.device, dtype=self.dtype)
        return caches.dynamic_cache(self.model.config, keys, values)

    def dynamic_cache(self, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
        """A DynamicCache over ``keys``/``values`` ``[layers, kv_heads, tokens, head_dim]`` (layers are views)."""
        return caches.dynamic_cache(self.model.config, keys, values)

    @staticmethod
    def scatter_cache(keys: torch.Tensor, values: torch.Tensor) -> ScatterCache:
        """A :class:`ScatterCache` over ``keys``/``values`` ``[layers, kv_heads, tokens, head_dim]`` (views)."""
        return ScatterCache(keys, values)

    def empty_kv(self, num_tokens: int = 0, start: int = 0) -> ChunkKV:
        """A placeholder ChunkKV of zeros (``num_tokens`` tokens at positions ``start..``)."""
        s = self.spec
        z = torch.zeros(s.num_layers, s.num_kv_heads, num_tokens, s.head_dim, dtype=self.dtype, device=self.device)
        return ChunkKV(z, z.clone(), torch.arange(start, start + num_tokens), self.fingerprint)

    crop_cache = staticmethod(caches.crop_cache)
    cache_to_kv = staticmethod(caches.cache_to_kv)

    @torch.no_grad()
    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: Cache,
        start: int,
        logits: LogitsWanted = "all",
        *,
        steer: Steer = PLAIN,
        rider: Rider | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` on top of ``cache`` (appending); return fp32 logits.

        ``logits`` says where they are computed: ``"all"`` ``[T, vocab]``; ``"last"`` ``[1, vocab]``
        (a prefill that only samples the next token); ``"none"`` ``[0, vocab]`` (a pass run for its
        cache; on a ``DynamicCache`` its last layer only writes its K/V, bit for bit what the whole
        layer writes on the CPU, tested: ``ragkv.model.lean.kv_only_last_layer``). The LM head over
        a 150K vocabulary is about a quarter of a prefill's compute, and its fp32 output at 1.5K
        tokens about 0.9 GB: computed only where it is read.

        ``steer``: what the pass does besides (a probe, decode weights, the step kind; see
        :class:`ragkv.model.attention.Steer`). ``rider``: a decode step of a batch that rides on
        this pass (:meth:`ragkv.model.batch.DecodeBatch.carried_step`), its rows' logits left in
        ``rider.logits``; an empty ``token_ids`` carries nothing.
        """
        if logits not in _LOGITS_WANTED:
            raise ValueError(f"logits must be one of {_LOGITS_WANTED}, got {logits!r}")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if rider is not None and ids.shape[1] > 0:
            if rider.batch.adapter is not self or not steer.plain_attention or steer.weights != "model":
                raise ValueError("a rider rides on a plain pass of its own batch's model")
            piece_logits, rider.logits = rider.batch.carried_step(rider.tokens, ids[0], cache, start, logits)
            return piece_logits
        if steer is PLAIN and ids.shape[1] > 1:
            steer = self._prefill_steer(cache, start, ids.shape[1])
        model, kw = self.model_for(steer.weights), self._steering(steer)
        pos = torch.arange(start, start + ids.shape[1], device=self.device).unsqueeze(0)
        if logits == "none":  # the decoder stack alone: no head at all
            inner = model.model

            def stack() -> None:
                inner(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(type(inner)): cache}, **kw)

            # nothing reads the last layer's output: only its K/V (a probe records its attention, and a
            # carried step reads its rows' output: those run it whole)
            if steer.probe is None and steer.carry is None and type(cache) is DynamicCache:
                kv_only_last_layer(model, stack, cache)
            else:
                stack()
            return torch.zeros((0, self.spec.vocab_size), dtype=torch.float32, device=self.device)
        kw |= {cache_kwarg(type(model)): cache, "logits_to_keep": 1 if logits == "last" else 0}
        return model(input_ids=ids, position_ids=pos, use_cache=True, **kw).logits[0].float()

    def model_for(self, weights: DecodeWeights) -> Any:
        """The model whose linear layers read ``weights``: the loaded one for ``"model"``, else its
        quantized copy (``ragkv.model.quant.quantized``: made once, every other module shared)."""
        if weights == "model":
            return self.model
        if self.device.type != "cpu":
            raise ValueError(f"{weights} decode weights use torch's CPU kernels; on {self.device} use 'model'")
        return quantized(self.model, weights)

    def _steering(self, steer: Steer) -> dict[str, Any]:
        """The keyword arguments that hand ``steer`` to the attention calls (none for a plain pass)."""
        if steer.plain_attention:
            return {}
        if not is_dispatched(self.model):
            raise RuntimeError(
                f"{self.name}'s attention implementation was changed to {self.model.config._attn_implementation!r} "
                "after its ModelAdapter was made; make a new ModelAdapter (it installs ragkv's dispatcher again)"
            )
        return {STEER_KWARG: steer}

    def prefill_kv(
        self, token_ids: Sequence[int], past: Sequence[ChunkKV] = (), *, probe: AttentionProbe | None = None
    ) -> ChunkKV:
        """The KV of ``token_ids`` computed after ``past`` (positions continue after it); ``probe``
        records the pass's attention weights."""
        if not len(token_ids):
            raise ValueError("prefill_kv needs at least one token")
        start = sum(p.num_tokens for p in past)
        self.check_context(start + len(token_ids))
        cache = self.build_cache(past)
        self.forward(token_ids, cache, start, logits="none", steer=PLAIN if probe is None else Steer(probe=probe))
        return self.cache_to_kv(cache, start, start + len(token_ids), self.fingerprint)

    def suffix_logits(
        self, context: Sequence[ChunkKV], suffix_ids: Sequence[int], answer_ids: Sequence[int] = ()
    ) -> torch.Tensor:
        """fp32 logits ``[len(suffix) + len(answer), vocab]`` of suffix (+ answer) on top of ``context``."""
        start = sum(p.num_tokens for p in context)
        return self.forward(list(suffix_ids) + list(answer_ids), self.build_cache(context), start)

    # ---- layer primitives for fusion ------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[1, T, hidden]`` of ``token_ids`` ([T])."""
        return self._inner.embed_tokens(token_ids.to(self.device, non_blocking=True).reshape(1, -1))

    def position_embeddings(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the model's layers at ``positions`` (``[T]``, or ``[B, q]``: a row each), in ``like``'s dtype."""
        pos = positions.to(self.device, non_blocking=True)
        return self._inner.rotary_emb(like, pos if pos.dim() == 2 else pos.reshape(1, -1))

    def causal_mask(self, query_pos: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Exact causal mask for queries at ``query_pos`` over ``num_keys`` slots: the query at p sees slots <= p.

        ``query_pos``: ``[q]`` int64, on the host (so the checks below cost no device sync). Under
        SDPA on CUDA, queries that are the last ``q`` slots get torch's lower-right causal bias: no
        ``[q, keys]`` tensor at all, the flash and memory-efficient kernels apply it (on the CPU torch
        would build one per call). Otherwise the additive mask ``[1, 1, q, num_keys]`` in ``dtype``
        (:func:`ragkv.model.masks.causal_mask_at`).
        """
        if self._lower_right_bias_is_free() and _is_tail(query_pos, num_keys):
            return causal_lower_right(int(query_pos.numel()), num_keys)
        return causal_mask_at(query_pos, num_keys, dtype, self.device)

    def position_mask(
        self,
        query_pos: torch.Tensor,
        num_keys: int,
        dtype: torch.dtype,
        device_pos: torch.Tensor | None = None,
        kernel: PositionKernel | None = None,
    ) -> torch.Tensor | PositionMask:
        """:meth:`causal_mask` for a pass whose attention calls ragkv's dispatcher sees (a fused pass's
        layers): the lower-right bias where it is free, else a :class:`~ragkv.model.masks.PositionMask`,
        which the dispatcher makes into a tensor only where a call needs one (not for ragkv's CPU
        kernel; a block of rows at a time where the whole mask would be large). ``query_pos``: ``[q]``
        on the host; ``device_pos``: the same on the model's device where the caller has it;
        ``kernel``: an attention kernel computing the mask's plain calls from the positions (a GPU's,
        ``ragkv.gpu.attention``). Shared by every layer of the pass."""
        if self._lower_right_bias_is_free() and _is_tail(query_pos, num_keys):
            return causal_lower_right(int(query_pos.numel()), num_keys)
        if not is_dispatched(self.model):  # the mask would reach transformers' own attention
            return causal_mask_at(query_pos if device_pos is None else device_pos, num_keys, dtype, self.device)
        return PositionMask(query_pos, num_keys, dtype, self.device, device_pos=device_pos, kernel=kernel)

    def scattered(self, query_pos: torch.Tensor) -> Steer:
        """The steer of a prefill pass whose queries sit at slots ``query_pos`` under :meth:`causal_mask`.

        On a CPU with AVX512-BF16 for a bf16 model, or with AVX2 and FMA for an fp32 one, its
        attention calls run ragkv's native kernel from the positions
        (:mod:`ragkv.model.native_attention`; the mask stays for any call the kernel does not take);
        elsewhere :data:`PLAIN`. ``query_pos``: ``[q]`` on the host.
        """
        if self.device.type != "cpu" or not attention_available(self.dtype):
            return PLAIN
        return Steer(query_pos=query_pos.to(torch.int64).contiguous())

    def _prefill_steer(self, cache: Cache, start: int, count: int) -> Steer:
        """The steer of a plain prefill pass of ``count`` tokens after ``start`` cached ones: ragkv's kernel
        where it is faster than torch's attention, else :data:`PLAIN`.

        A prefill's queries are the last ``count`` slots, so its attention is the kernel's case with
        positions ``start..``: one query per slot, each seeing the slots up to its own, as the model's
        causal mask says. Taken only where that holds for sure (a :class:`DynamicCache` holding exactly
        ``start`` tokens: its slots are the positions) and where it was measured to pay: a bf16 model
        on a CPU with AVX512-BF16, where the kernel ran 1.7-4x faster than torch's SDPA per call and
        whole prefills 1.15-1.33x faster (``experiments/prefill_attention.py``, docs/benchmarks.md).
        fp32 passes keep torch's attention: per call the AVX2 kernel ranged from 0.8x to 2x SDPA's
        speed by shape, and it was never measured on the AVX2-only CPUs where fp32 is the default.
        """
        if self.dtype != torch.bfloat16 or type(cache) is not DynamicCache or not is_dispatched(self.model):
            return PLAIN
        if cache.get_seq_length() != start:
            return PLAIN
        return self.scattered(torch.arange(start, start + count))

    def _lower_right_bias_is_free(self) -> bool:
        """Whether SDPA applies a lower-right causal bias without building a mask: SDPA on CUDA.

        The attention implementation is read per call (the config may be switched after loading).
        """
        sdpa = str(self.model.config._attn_implementation or "").removeprefix("ragkv_") == "sdpa"
        return sdpa and self.device.type == "cuda"

    @torch.no_grad()
    def run_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ScatterCache,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | PositionMask,
        steer: Steer = PLAIN,
    ) -> torch.Tensor:
        """Run decoder layer ``layer_idx`` for the tokens at ``positions`` (``hidden``: [1, q, hidden]).

        Their fresh K/V overwrite ``cache`` at their own slots; their queries attend over every slot
        the mask allows. This is the model's own layer, called through the Cache seam; ``steer``
        as for :meth:`forward` (fusion's question pass probes).
        """
        cache.set_write_slots(layer_idx, positions.to(self.device))
        layer = self._inner.layers[layer_idx]
        if isinstance(mask, PositionMask) and not is_dispatched(self.model):
            mask = mask.dense()  # the implementation was switched since the pass began: transformers' own
        out = layer(
            hidden,
            attention_mask=mask,
            position_ids=positions.to(self.device).reshape(1, -1),
            use_cache=True,
            position_embeddings=position_embeddings,
            **{cache_kwarg(type(layer)): cache},
            **self._steering(steer),
        )
        return out[0] if isinstance(out, tuple) else out

    def layer_attention(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        positions: torch.Tensor,
        cache: ScatterCache,
        mask: torch.Tensor | PositionMask,
        steer: Steer = PLAIN,
    ) -> torch.Tensor:
        """What decoder layer ``layer_idx``'s attention module does in :meth:`run_layer` once it has its
        rotated ``query`` ``[1, heads, q, D]`` and ``key``/``value`` ``[1, kv_heads, q, D]``: the key and
        value written at slots ``positions`` (on the device) of ``cache``, then the model's attention
        function over every slot ``mask`` allows, called as the module calls it. Returns its output,
        ``[1, q, heads, D]``. For a layer run in parts (``ragkv.gpu.graphs``); the layers must be ones
        :attr:`writes_layer_kv` knows."""
        attn = self._inner.layers[layer_idx].self_attn
        cache.set_write_slots(layer_idx, positions)
        keys, values = cache.update(key, value, layer_idx)
        impl = self.model.config._attn_implementation
        if isinstance(mask, PositionMask) and not is_dispatched(self.model):
            mask = mask.dense()
        # as the module looks it up: a registered implementation, else its modeling file's eager one
        fn = ALL_ATTENTION_FUNCTIONS[impl] if impl in ALL_ATTENTION_FUNCTIONS else _eager_attention(attn)
        out, _ = fn(
            attn,
            query,
            keys,
            values,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=getattr(attn, "sliding_window", None),  # None wherever the layers are known
            position_ids=positions.reshape(1, -1),
            use_cache=True,
            **self._steering(steer),
        )
        return out

    @property
    def writes_layer_kv(self) -> bool:
        """Whether :meth:`write_layer_kv` can run here (decoder layers whose arithmetic ragkv knows:
        Llama, Mistral, Qwen2, Qwen3; ``ragkv.model.lean.layer_parts``)."""
        return layer_parts(self.model) is not None

    def write_layer_kv(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ScatterCache,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write layer ``layer_idx``'s fresh K/V for ``hidden`` ``[1, q, hidden]`` at slots ``positions``, and
        run nothing else of the layer: the operations :meth:`run_layer` writes them with (bit for bit
        for the same rows), for rows whose output the pass does not read (fusion's rows a check layer
        drops, its chunk rows in the last layer).

        Raises RuntimeError where :attr:`writes_layer_kv` is False.
        """
        parts = layer_parts(self.model)
        if parts is None:
            raise RuntimeError(f"{self.name}: its decoder layers cannot be run in parts; run_layer runs them whole")
        key, value = layer_kv(parts[layer_idx], hidden, position_embeddings)
        cache.set_write_slots(layer_idx, positions.to(self.device))
        cache.update(key, value, layer_idx)

    @torch.no_grad()
    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Cache,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        steer: Steer,
    ) -> torch.Tensor:
        """Every decoder layer over ``hidden`` ``[B, q, hidden]`` at ``positions`` ``[B, q]``, on ``cache``.

        A decode step (``steer.kind == "decode"``: one query per row) and a prefill piece carrying
        one (``steer.carry``) call this; the layers are those of :meth:`model_for` ``steer.weights``.
        """
        model = self.model_for(steer.weights)
        if steer.kind == "decode" and steer.probe is None and steer.carry is None and hidden.shape[1] == 1:
            plan = lean_plan(model) if self.device.type == "cpu" else None
            if plan is not None:  # the same arithmetic without transformers' per-layer machinery
                return lean_layers(plan, hidden, cache, position_embeddings, mask)
        kw = self._steering(steer)
        for layer in model.model.layers:
            out = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                position_embeddings=position_embeddings,
                **{cache_kwarg(type(layer)): cache},
                **kw,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def final_logits(self, hidden: torch.Tensor, weights: DecodeWeights = "model") -> torch.Tensor:
        """fp32 logits ``[B, q, vocab]`` of the last layer's ``hidden`` ``[B, q, hidden]`` (the LM head of
        :meth:`model_for` ``weights``)."""
        return self.model_for(weights).lm_head(self._inner.norm(hidden)).float()


def _eager_attention(module: Any) -> Any:
    """The modeling file's own eager attention function for an attention ``module``."""
    return sys.modules[type(module).__module__].eager_attention_forward


def load_model(
    spec: str | tuple[Any, Any] | ModelAdapter = "smollm2-135m",
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    offline: bool = False,
) -> ModelAdapter:
    """Resolve a model: an alias (``smollm2-135m``), a local path, a .gguf file, a Hugging Face hub
    name, or a loaded (model, tokenizer); place it on ``device`` in ``dtype``.

    ``device``: ``auto`` (None: the same) picks CUDA, then MPS, else the CPU; ``cpu``, ``cuda[:N]``,
    ``mps``. ``dtype``: ``auto`` picks bf16 on CUDA and on CPUs with native bf16 matmuls, fp16 on
    MPS, else fp32; ``float32``/``bfloat16``/``float16``; None keeps the loader's choice (fp32 for
    the default model). Hub names download into the Hugging Face cache unless ``offline`` or
    ``HF_HUB_OFFLINE=1`` (see ``ragkv.model.loading``). A loaded adapter is returned as is.
    """
    from ragkv.model.gguf_header import weight_bits
    from ragkv.model.loading import gguf_file, resolve
    from ragkv.model.placement import dtype_reason, resolve_device, resolve_dtype

    if isinstance(spec, ModelAdapter):
        return spec
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if isinstance(spec, tuple):
        model, tokenizer = spec
        name = getattr(model.config, "_name_or_path", "") or "custom"
    else:
        model, tokenizer, name = resolve(spec, dtype=dt, offline=offline)
    model = model.to(device=dev, dtype=dt) if dt is not None else model.to(dev)
    adapter = ModelAdapter(model, tokenizer, name=name)
    adapter.dtype_reason = dtype_reason(dtype, dev)
    if isinstance(spec, str) and (path := gguf_file(spec)) is not None:
        adapter.weight_bits = weight_bits(path)
    logger.info("model %s on %s in %s (%s)", name, dev, adapter.dtype, adapter.dtype_reason)
    return adapter
