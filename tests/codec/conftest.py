"""Shared fixtures: fresh random KV every run (the seed is printed, so a failure can be replayed)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from ragkv.codec import Expected, decode, encode
from ragkv.digests import sha256_hex
from ragkv.types import ChunkKV, CodecSpec, StorageKey, tenant_namespace

KVFactory = Callable[..., ChunkKV]
KEY = StorageKey(f"{tenant_namespace('test')}/{sha256_hex(b'a chunk')}")  # the key test blobs are stored under


def encoded(kv: ChunkKV, name: str = "raw", level: int = 0, secret: bytes | None = None) -> bytes:
    """``kv``'s bitstream under :data:`KEY`."""
    return encode(kv, CodecSpec(name, level), key=KEY, secret=secret).data


def expected(kv: ChunkKV, name: str = "raw", level: int = 0, secret: bytes | None = None) -> Expected:
    """What a reader of ``kv`` under :data:`KEY` expects."""
    return Expected.of(kv, CodecSpec(name, level), KEY, secret)


def roundtrip(kv: ChunkKV, name: str = "raw", level: int = 0, **decode_kw: object) -> ChunkKV:
    """``kv`` encoded and decoded again, with the expectation the query path would have."""
    return decode(encoded(kv, name, level), expect=expected(kv, name, level), **decode_kw)  # type: ignore[arg-type]


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
