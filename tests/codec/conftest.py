"""Shared fixtures: fresh random KV every run (the seed is printed, so a failure can be replayed)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from ragkv.types import ChunkKV

KVFactory = Callable[..., ChunkKV]


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("RAGKV_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"RAGKV_TEST_SEED={value}")
    return value


@pytest.fixture
def make_kv(seed: int) -> KVFactory:
    """Build KV that looks like a model's: per-channel scales and means, a small first token."""
    gen = torch.Generator().manual_seed(seed)

    def factory(
        layers: int = 4,
        heads: int = 2,
        tokens: int = 37,
        head_dim: int = 16,
        dtype: torch.dtype = torch.float16,
        start: int = 0,
    ) -> ChunkKV:
        shape = (layers, heads, tokens, head_dim)
        out = []
        for _ in range(2):
            scale = torch.rand(layers, heads, 1, head_dim, generator=gen) * 2 + 0.2
            mean = torch.randn(layers, heads, 1, head_dim, generator=gen)
            x = torch.randn(shape, generator=gen) * scale + mean
            if tokens:
                x[:, :, 0] *= 0.05  # attention-sink-like first token
            out.append(x.to(dtype))
        return ChunkKV(
            keys=out[0], values=out[1], positions=torch.arange(start, start + tokens), model_fingerprint="test"
        )

    return factory
