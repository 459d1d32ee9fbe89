"""Store tier throughput and latency for chunk-sized blobs.

A chunk of 256-512 tokens of the default model is about 3-6 MB of raw fp16 KV and 0.5-1.5 MB
once compressed, so blobs of those sizes are what the tiers move. Blobs are random bytes
(compressed KV does not compress further). Each tier is measured on its own; the baseline,
measured in the same run, is plain files in a temporary directory (write, read back): what
the local filesystem gives with no index, no atomic rename and no network.

Run: ``python -m ragkv.bench.store memory:// /tmp/ragkv-bench redis://127.0.0.1:6379/15 file:///tmp/obj``
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ragkv.bench import table
from ragkv.cache.registry import open_tier
from ragkv.cache.tier import Tier
from ragkv.digests import sha256_hex
from ragkv.types import tenant_namespace

__all__ = ["run_store_bench", "format_table", "main"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BLOB_SIZES = (256 << 10, 1 << 20, 4 << 20)
_BENCH_TENANT = "ragkv-bench"


class _Target(Protocol):
    @property
    def name(self) -> str: ...

    def put(self, key: str, value: bytes) -> bool: ...
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]: ...
    def delete(self, key: str) -> bool: ...


class _RawFiles:
    """The baseline: one plain file per key, written and read with open()."""

    name = "baseline: raw files"

    def __init__(self, directory: str) -> None:
        self._dir = Path(directory)

    def _path(self, key: str) -> Path:
        return self._dir / key.replace("/", "_")

    def put(self, key: str, value: bytes) -> bool:
        self._path(key).write_bytes(value)
        return True

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        return path.read_bytes() if path.exists() else None

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        return {k: v for k in keys if (v := self.get(k)) is not None}

    def delete(self, key: str) -> bool:
        self._path(key).unlink(missing_ok=True)
        return True


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _bench_tier(tier: _Target, blob_bytes: int, n: int) -> dict[str, Any]:
    run = uuid.uuid4().hex
    namespace = tenant_namespace(_BENCH_TENANT)
    keys = [f"{namespace}/{sha256_hex(f'{run}:{blob_bytes}:{i}'.encode())}" for i in range(n)]
    blobs = [os.urandom(blob_bytes) for _ in range(n)]
    tier.put(keys[0], blobs[0])  # warm up: connections, directories
    tier.get(keys[0])
    puts: list[float] = []
    gets: list[float] = []
    stored = 0
    try:
        for key, blob in zip(keys, blobs, strict=True):
            ok, seconds = _timed(tier.put, key, blob)
            stored += bool(ok)
            puts.append(seconds)
        for key, blob in zip(keys, blobs, strict=True):
            value, seconds = _timed(tier.get, key)
            if value is not None and value != blob:
                raise RuntimeError(f"{tier.name} returned different bytes for {key}")
            gets.append(seconds)
        found, many_seconds = _timed(tier.get_many, keys)
    finally:
        for key in keys:
            tier.delete(key)
    mb = blob_bytes / 1e6
    return {
        "tier": tier.name,
        "blob_mb": round(mb, 3),
        "n": n,
        "stored": stored,
        "put_mb_s": round(mb * n / sum(puts), 1),
        "put_p50_ms": round(statistics.median(puts) * 1e3, 3),
        "put_p99_ms": round(_percentile(puts, 0.99) * 1e3, 3),
        "get_mb_s": round(mb * n / sum(gets), 1),
        "get_p50_ms": round(statistics.median(gets) * 1e3, 3),
        "get_p99_ms": round(_percentile(gets, 0.99) * 1e3, 3),
        "get_many_mb_s": round(mb * len(found) / many_seconds, 1) if found else 0.0,
    }


def run_store_bench(
    urls: list[str], blob_sizes: Sequence[int] = DEFAULT_BLOB_SIZES, n: int = 20
) -> list[dict[str, Any]]:
    """Measure put/get throughput (MB/s) and latency (p50/p99 ms) of each tier per blob size.

    Args:
        urls: tier URLs, each measured on its own.
        blob_sizes: value sizes in bytes.
        n: values per size (each put, then each read back, then all read at once by get_many).

    Returns:
        One row per (tier, blob size), the baseline's first: ``tier, blob_mb, n, stored,
        put_mb_s, put_p50_ms, put_p99_ms, get_mb_s, get_p50_ms, get_p99_ms, get_many_mb_s,
        get_p50_vs_baseline``.
    """
    if n < 1 or not urls:
        raise ValueError("run_store_bench needs at least one URL and n >= 1")
    with tempfile.TemporaryDirectory(prefix="ragkv-bench-") as directory:
        rows = [_bench_tier(_RawFiles(directory), size, n) for size in blob_sizes]
    for url in urls:
        tier: Tier = open_tier(url)
        try:
            rows += [_bench_tier(tier, size, n) for size in blob_sizes]
        finally:
            tier.close()
    baseline = {row["blob_mb"]: row["get_p50_ms"] for row in rows[: len(blob_sizes)]}
    for row in rows:
        row["get_p50_vs_baseline"] = round(row["get_p50_ms"] / baseline[row["blob_mb"]], 2)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The store bench's rows as a Markdown table, one column per row key."""
    return table.format_table(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``python -m ragkv.bench.store URL [URL...] [--n N] [--sizes 0.25,1,4]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="+", help="tier URLs, e.g. memory:// /tmp/kv redis://127.0.0.1:6379/15")
    parser.add_argument("--n", type=int, default=20, help="values per blob size")
    parser.add_argument("--sizes", default="0.25,1,4", help="blob sizes in MiB, comma-separated")
    args = parser.parse_args(argv)
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes.split(",")]
    print(format_table(run_store_bench(args.urls, sizes, args.n)))  # the table is the output


if __name__ == "__main__":
    main()
