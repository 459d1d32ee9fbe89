"""Registry, argument checking and a user-defined codec."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from ragkv.codec import (
    BitstreamHeader,
    Codec,
    CodecPayload,
    available_codecs,
    decode,
    encode,
    get_codec,
    register_codec,
)
from ragkv.codec._tensors import from_section, to_bytes
from ragkv.types import DEFAULT_CODEC, ChunkKV, CodecSpec, StorageKey
from tests.codec.conftest import KEY, KVFactory, encoded, expected, roundtrip


def test_builtin_codecs_and_levels() -> None:
    codecs = available_codecs()
    assert codecs["raw"] == (0,) and codecs["int8"] == (0,) and codecs["int4"] == (0,)
    assert len(codecs["cachegen"]) >= 3
    assert DEFAULT_CODEC.level in codecs[DEFAULT_CODEC.name]


def test_unknown_codec_or_level_is_a_value_error(make_kv: KVFactory) -> None:
    with pytest.raises(ValueError, match="unknown codec 'nope'.*available"):
        get_codec("nope")
    with pytest.raises(ValueError, match="levels"):
        encode(make_kv(), CodecSpec("cachegen", 99), key=KEY)
    with pytest.raises(ValueError, match="level"):
        CodecSpec("cachegen", -1)
    with pytest.raises(TypeError, match="CodecSpec"):
        encode(make_kv(), "cachegen", key=KEY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="storage key"):
        encode(make_kv(), CodecSpec("raw", 0), key=StorageKey("no-namespace"))


def test_broken_inputs_are_refused(make_kv: KVFactory) -> None:
    kv = make_kv(dtype=torch.float32)
    bad = kv.keys.clone()
    bad[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        encoded(ChunkKV(bad, kv.values, kv.positions, "test"), "cachegen")
    ints = ChunkKV(kv.keys.to(torch.int32), kv.values.to(torch.int32), kv.positions, "test")
    with pytest.raises(ValueError, match="float16"):
        encoded(ints, "raw")
    huge = ChunkKV(kv.keys * 1e6, kv.values, kv.positions, "test")
    with pytest.raises(ValueError, match="fp16 range"):
        encoded(huge, "raw")
    with pytest.raises(TypeError, match="floating"):
        decode(encoded(kv), expect=expected(kv), dtype=torch.int8)


class _Negate(Codec):
    """A toy codec: fp32 of the negated tensors."""

    name: ClassVar[str] = "test-negate"
    levels: ClassVar[tuple[int, ...]] = (0, 1)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, level: int) -> CodecPayload:
        return CodecPayload(sections=(to_bytes(-keys.float()), to_bytes(-values.float())), params={"sign": -1})

    def decode(
        self, header: BitstreamHeader, sections: Sequence[memoryview], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sign = header.params["sign"]
        return tuple(from_section(s, torch.float32, header.shape, device, dtype) * sign for s in sections)  # type: ignore[return-value]


def test_user_codec_registers_and_round_trips(make_kv: KVFactory) -> None:
    register_codec(_Negate)
    register_codec(_Negate)  # idempotent for the same class
    assert available_codecs()["test-negate"] == (0, 1)
    kv = make_kv(dtype=torch.float32)
    out = roundtrip(kv, "test-negate", 1)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)

    class Impostor(_Negate):
        pass

    with pytest.raises(ValueError, match="already taken"):
        register_codec(Impostor)
    with pytest.raises(TypeError):
        register_codec(int)  # type: ignore[arg-type]
