"""``ragkv bench store --model``: assembling k chunks' caches from each tier vs prefilling them.

For each tier: k chunk caches (encoded with the chosen codec and level) are written, then read
back, decoded, re-rotated to their offsets and assembled into one prompt cache (naive fusion:
the I/O and decode path alone). The baseline, timed in the same run, is prefilling the same
prefix + k chunks from scratch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ragkv import codec
from ragkv.cache.prefetch import prefetch
from ragkv.cache.registry import open_tier
from ragkv.cache.tier import Tier
from ragkv.digests import tokens_digest
from ragkv.fusion import FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.selection import FusionConfig
from ragkv.types import ChunkKV, tenant_namespace

__all__ = ["run_assemble_bench", "format_assemble_table"]


def _chunks(adapter: ModelAdapter, k: int, tokens: int) -> tuple[list[int], list[list[int]]]:
    from ragkv.retriever.corpus import stdlib_corpus

    text = " ".join(d.text for d in stdlib_corpus())
    ids = adapter.encode(text)
    prefix = adapter.encode(adapter.layout(None).prefix)
    return prefix, [ids[i * tokens : (i + 1) * tokens] for i in range(k)]


def _sequential(
    adapter: ModelAdapter, tier: Tier, keys: list[str], pre: ChunkKV, chunks: list[list[int]]
) -> tuple[float, float, float]:
    """Read every blob, then decode them, then place them: (read, decode, total) ms."""
    t0 = time.perf_counter()
    got = [tier.get(key) for key in keys]
    t1 = time.perf_counter()
    kvs = [codec.decode(b, dtype=adapter.dtype) for b in got if b is not None]
    t2 = time.perf_counter()
    fuse(adapter, FusionInput(pre, kvs, chunks), FusionConfig(method="naive"))
    return (t1 - t0) * 1000, (t2 - t1) * 1000, (time.perf_counter() - t0) * 1000


def _pipelined(adapter: ModelAdapter, tier: Tier, keys: list[str], pre: ChunkKV, chunks: list[list[int]]) -> float:
    """The query path's loader (chunk i+1 is read while chunk i decodes), then placement: total ms."""
    t0 = time.perf_counter()
    kvs = [codec.decode(b, dtype=adapter.dtype) for b in prefetch(keys, tier.get) if b is not None]
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
    blobs = [codec.encode(adapter.prefill_kv(c, past=[pre]), codec_name, level).data for c in chunks]
    ns = tenant_namespace("ragkv-bench")
    keys = [f"{ns}/{tokens_digest(c)}" for c in chunks]
    n_tokens = len(prefix) + k * tokens

    def prefill() -> float:
        t0 = time.perf_counter()
        adapter.forward(prefix + [t for c in chunks for t in c], adapter.build_cache([]), 0)
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
                args = (adapter, tier, keys, pre, chunks)
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


def format_assemble_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'tier':<28}{'k':>3}{'tokens':>8}{'MB':>7}{'read ms':>9}{'decode ms':>11}{'total ms':>10}"
        f"{'pipelined ms':>14}{'vs prefill':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['tier']:<28}{r['k']:>3}{r['tokens']:>8}{r['mb']:>7.1f}{r['read_ms']:>9.1f}"
            f"{r['decode_ms']:>11.1f}{r['assemble_ms']:>10.1f}{r['pipelined_ms']:>14.1f}{r['speedup']:>10.1f}x"
        )
    return "\n".join(lines)
