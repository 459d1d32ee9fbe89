"""A small crafted blob whose header claims a huge tensor is refused before anything is allocated.

Allocation is measured twice, because neither meter sees everything: tracemalloc sees Python and
numpy allocations, torch's profiler sees torch's CPU allocator (tracemalloc does not).
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Callable

import pytest
import torch
import zstandard
from torch.profiler import ProfilerActivity, profile

from ragkv.codec import FORMAT_VERSION, BitstreamHeader, Expected, decode
from ragkv.codec.bitstream import pack
from ragkv.errors import CodecError, IncompatibleCacheError
from ragkv.types import ChunkKV, CodecSpec, ModelFingerprint
from tests.codec.conftest import KEY

# SmolLM2-135M's shape; a 512-token chunk decodes to 2 * 30 * 3 * 512 * 64 * 4 B = 23.6 MB (fp32).
LAYERS, HEADS, HEAD_DIM = 30, 3, 64
LIMIT = 10 * 2**20


def _bomb(tokens: int) -> bytes:
    """A well-formed cachegen blob for ``tokens`` tokens of zeros, with valid checksums and zstd
    frames that declare their true sizes: only its claimed size is hostile."""
    count = HEADS * (tokens - 1) * HEAD_DIM  # symbols per stream
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    stream = cctx.compress(bytes(count))  # int8 symbols, all zero
    tables = cctx.compress(bytes(3 * 2 * LAYERS * HEADS * HEAD_DIM))
    sections = [bytes(2 * 2 * LAYERS * HEADS * HEAD_DIM), tables] + [stream] * (2 * LAYERS)
    header = BitstreamHeader(
        format_version=FORMAT_VERSION,
        codec="cachegen",
        level=0,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        num_tokens=tokens,
        head_dim=HEAD_DIM,
        source_dtype="float16",
        model_fingerprint="test",
        position_runs=((0, tokens),),
        section_sizes=tuple(len(s) for s in sections),
        params={"bits": [8] * (2 * LAYERS)},
        storage_key=KEY,
    )
    return pack(header, sections)


def _allocated(run: Callable[[], object]) -> tuple[int, int]:
    """(tracemalloc peak, bytes torch's CPU allocator handed out) of ``run()``, measured in two runs
    (each meter's own bookkeeping stays out of the other's count)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(CodecError):
            run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, contextlib.suppress(CodecError):
        run()
    return peak, sum(max(0, e.cpu_memory_usage) for e in prof.events())


EXPECT = Expected(KEY, ModelFingerprint("test"), CodecSpec("cachegen", 0), LAYERS, HEADS, HEAD_DIM, num_tokens=512)


def test_a_header_claiming_2_gib_is_refused_with_less_than_10_mb_allocated() -> None:
    tokens = 2**31 // (2 * LAYERS * HEADS * HEAD_DIM * 4)  # keys + values, fp32: 2 GiB
    bomb = _bomb(tokens)
    assert len(bomb) < 200_000  # a few tens of KB of bytes on the wire
    with pytest.raises(IncompatibleCacheError, match="shape"):
        decode(bomb, expect=EXPECT)
    peak, torch_bytes = _allocated(lambda: decode(bomb, expect=EXPECT))
    assert peak < LIMIT and torch_bytes < LIMIT, (peak, torch_bytes)


def test_the_meters_see_a_real_decode() -> None:
    """The same kind of blob at the expected size decodes, and both meters see its allocations:
    the bound above is a measurement, not a blind spot."""
    blob = _bomb(EXPECT.num_tokens)
    out = decode(blob, expect=EXPECT)
    assert isinstance(out, ChunkKV) and out.keys.shape == EXPECT.shape and not out.keys.any()
    peak, torch_bytes = _allocated(lambda: decode(blob, expect=EXPECT))
    decoded = 2 * 4 * torch.Size(EXPECT.shape).numel()
    assert torch_bytes >= decoded  # the fp32 output
    assert peak >= decoded // 4  # int16 symbols (numpy)
