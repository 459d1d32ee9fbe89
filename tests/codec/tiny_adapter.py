"""A stand-in for ``ragkv.model.ModelAdapter`` over a tiny random-weight Llama (no download)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ragkv.types import ChunkKV


class TinyLlamaAdapter:
    """The adapter methods the codec benchmark uses, on a model built from a config."""

    fingerprint = "tiny-llama-test"
    eos_token_ids: frozenset[int] = frozenset()  # answers run to max_new_tokens

    def __init__(self, seed: int = 0, layers: int = 3, vocab: int = 96) -> None:
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        )
        self.model = LlamaForCausalLM(config).eval()
        self.vocab = vocab

    def _ids(self, text: str) -> list[int]:
        return [3 + (ord(c) % (self.vocab - 3)) for c in text]

    def chat_segments(
        self, system: str, chunks: list[str], question: str
    ) -> tuple[list[int], list[list[int]], list[int]]:
        return [1, *self._ids(system)], [self._ids(c) for c in chunks], [*self._ids(question), 2]

    def _cache(self, past: Sequence[ChunkKV]) -> tuple[DynamicCache, int]:
        cache = DynamicCache()
        if past:
            keys = torch.cat([kv.keys.float() for kv in past], dim=2)
            values = torch.cat([kv.values.float() for kv in past], dim=2)
            for layer in range(keys.shape[0]):
                cache.update(keys[layer][None], values[layer][None], layer)
        return cache, sum(kv.num_tokens for kv in past)

    @torch.no_grad()
    def prefill_kv(self, token_ids: Sequence[int], past: Sequence[ChunkKV] = ()) -> ChunkKV:
        cache, start = self._cache(past)
        positions = torch.arange(start, start + len(token_ids))
        self.model(torch.tensor([list(token_ids)]), past_key_values=cache, position_ids=positions[None])
        keys = torch.stack([layer.keys[0, :, start:] for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:] for layer in cache.layers])
        return ChunkKV(
            keys=keys.contiguous(), values=values.contiguous(), positions=positions, model_fingerprint=self.fingerprint
        )

    @torch.no_grad()
    def suffix_logits(
        self, context: Sequence[ChunkKV], suffix_ids: Sequence[int], answer_ids: Sequence[int] = ()
    ) -> torch.Tensor:
        cache, start = self._cache(context)
        ids = [*suffix_ids, *answer_ids]
        out = self.model(
            torch.tensor([ids]), past_key_values=cache, position_ids=torch.arange(start, start + len(ids))[None]
        )
        return out.logits[0].float()

    def build_cache(self, context: Sequence[ChunkKV]) -> DynamicCache:
        return self._cache(context)[0]

    @torch.no_grad()
    def forward(
        self, token_ids: Sequence[int] | torch.Tensor, cache: DynamicCache, start: int, logits: str = "all"
    ) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
        pos = torch.arange(start, start + ids.shape[1])
        return self.model(ids, past_key_values=cache, position_ids=pos[None]).logits[0].float()
