"""``ragkv bench store --model``: assembling k chunks' caches from each tier vs prefilling them.

For each tier: k chunk caches (encoded with the chosen codec and level) are written, then read
back, decoded, re-rotated to their offsets and assembled into one prompt cache (naive fusion:
the I/O and decode path alone). The baseline, timed in the same run, is prefilling the same
prefix + k chunks from scratch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ragkv import codec
from ragkv.bench import table
from ragkv.bench.table import Column
from ragkv.cache.registry import open_tier
from ragkv.cache.tier import Tier
from ragkv.digests import tokens_digest
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.retriever.prefetch import prefetch
from ragkv.types import ChunkKV, CodecSpec, StorageKey, tenant_namespace

__all__ = ["TABLE", "run_assemble_bench", "format_assemble_table"]


def _chunks(adapter: ModelAdapter, k: int, tokens: int) -> tuple[list[int], list[list[int]]]:
    from ragkv.retriever.corpus import stdlib_corpus

    text = " ".join(d.text for d in stdlib_corpus())
    ids = adapter.encode(text)
    prefix = adapter.encode(adapter.layout(None).prefix)
    return prefix, [ids[i * tokens : (i + 1) * tokens] for i in range(k)]


def _decode(adapter: ModelAdapter, blob: bytes, expect: codec.Expected) -> ChunkKV:
    return codec.decode(blob, expect=expect, dtype=adapter.dtype)


def _sequential(
    adapter: ModelAdapter, tier: Tier, expects: list[codec.Expected], pre: ChunkKV, chunks: list[list[int]]
) -> tuple[float, float, float]:
    """Read every blob, then decode them, then place them: (read, decode, total) ms."""
    t0 = time.perf_counter()
    got = [tier.get(e.key) for e in expects]
    t1 = time.perf_counter()
    kvs = [_decode(adapter, b, e) for b, e in zip(got, expects, strict=True) if b is not None]
    t2 = time.perf_counter()
    fuse(adapter, FusionInput(pre, kvs, chunks), FusionConfig(method="naive"))
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (time.perf_counter() - t0) * 1000


def _pipelined(
    adapter: ModelAdapter, tier: Tier, expects: list[codec.Expected], pre: ChunkKV, chunks: list[list[int]]
) -> float:
    """The query path's loader (chunk i+1 is read while chunk i decodes), then placement: total ms."""
    t0 = time.perf_counter()
    fetched = prefetch([e.key for e in expects], tier.get)
    kvs = [_decode(adapter, b, e) for b, e in zip(fetched, expects, strict=True) if b is not None]
    fuse(adapter, FusionInput(pre, kvs, chunks), FusionConfig(method="naive"))
    return (time.perf_counter() - t0) * 1000


@torch.inference_mode()
def run_assemble_bench(
    adapter: ModelAdapter,
    urls: Sequence[str],
    *,
    k: int = 4,
    tokens: int = 400,
    codec_name: str = "raw",
    level: int = 0,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """One row per tier plus the prefill baseline; times are medians over ``repeats``."""
    prefix, chunks = _chunks(adapter, k, tokens)
    pre = adapter.prefill_kv(prefix)
    spec = CodecSpec(codec_name, level)
    ns = tenant_namespace("ragkv-bench")
    keys = [StorageKey(f"{ns}/{tokens_digest(c)}") for c in chunks]
    kvs = [adapter.prefill_kv(c, past=[pre]) for c in chunks]
    blobs = [codec.encode(kv, spec, key=key).data for kv, key in zip(kvs, keys, strict=True)]
    expects = [codec.Expected.of(kv, spec, key) for kv, key in zip(kvs, keys, strict=True)]
    n_tokens = len(prefix) + k * tokens

    def prefill() -> float:
        t0 = time.perf_counter()
        adapter.forward(prefix + [t for c in chunks for t in c], adapter.build_cache([]), 0, logits="last")
        return (time.perf_counter() - t0) * 1000

    base = statistics.median(prefill() for _ in range(repeats))
    rows: list[dict[str, Any]] = [
        dict(
            tier="baseline: prefill",
            k=k,
            tokens=n_tokens,
            read_ms=0.0,
            decode_ms=0.0,
            assemble_ms=base,
            pipelined_ms=base,
            speedup=1.0,
            mb=0.0,
        )
    ]
    for url in urls:
        tier = open_tier(url)
        try:
            for key, blob in zip(keys, blobs, strict=True):
                tier.put(key, blob)
            samples = []

            for r in range(repeats):  # alternate which goes first, so neither gets the warmer tier
                args = (adapter, tier, expects, pre, chunks)
                if r % 2:
                    p = _pipelined(*args)
                    samples.append((*_sequential(*args), p))
                else:
                    samples.append((*_sequential(*args), _pipelined(*args)))
            read, dec, total, pipelined = (statistics.median(s[i] for s in samples) for i in range(4))
            rows.append(
                dict(
                    tier=tier.name,
                    k=k,
                    tokens=n_tokens,
                    read_ms=read,
                    decode_ms=dec,
                    assemble_ms=total,
                    pipelined_ms=pipelined,
                    speedup=base / total,
                    mb=sum(map(len, blobs)) / 1e6,
                )
            )
            for key in keys:
                tier.delete(key)
        finally:
            tier.close()
    return rows


TABLE = (
    Column("tier"),
    Column("k"),
    Column("tokens"),
    Column("mb", "MB", "{:.1f}"),
    Column("read_ms", "read ms", "{:.1f}"),
    Column("decode_ms", "decode ms", "{:.1f}"),
    Column("assemble_ms", "total ms", "{:.1f}"),
    Column("pipelined_ms", "pipelined ms", "{:.1f}"),
    Column("speedup", "vs prefill", "{:.1f}x"),
)


def format_assemble_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The assembly bench's rows as a Markdown table (:data:`TABLE`'s columns)."""
    return table.format_table(rows, TABLE)
