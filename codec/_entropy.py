"""The entropy stage of ``cachegen``: one zstd frame per stream, decoded in parallel (private).

Measured on quantized KV symbols of SmolLM2-135M (380-token chunks, one stream per layer and
K/V): zstd's btultra strategy lands within 1% of the order-0 empirical entropy of each stream
(a third of it on a few streams, where zstd finds repeats), where level 3 is 9-16% above;
constriction's rANS reached the entropy exactly but decoded 14 M symbols/s against hundreds of
millions for zstd.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import zstandard

from ragkv.errors import CodecError

_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    chain_log=16,
    hash_log=16,
    search_log=1,
    min_match=7,
    target_length=16,
    strategy=zstandard.STRATEGY_BTULTRA,
    write_content_size=True,
    write_checksum=False,
)
_LOCAL = threading.local()
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_PARALLEL_MIN_BYTES = 1 << 16  # below this the thread hand-off costs more than it saves
_WORKERS = max(1, min(8, os.cpu_count() or 1))


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Building a btultra context costs about as much as compressing one stream: one per thread
    # and level, reused (a ZstdCompressor is not thread-safe either).
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_LOCAL, "cctx", None)
    if cache is None:
        cache = _LOCAL.cctx = {}
    if level not in cache:
        cache[level] = (
            zstandard.ZstdCompressor(level=level, write_content_size=True)
            if level
            else zstandard.ZstdCompressor(compression_params=_PARAMS)
        )
    return cache[level]


def compress_streams(streams: Sequence[bytes], level: int = 0) -> list[bytes]:
    """One zstd frame per stream, compressed in parallel; ``level`` 0 picks the tuned parameters.

    Frames do not depend on which thread made them: the output is deterministic.
    """

    def run(indices: range) -> list[bytes]:
        cctx = _compressor(level)
        return [cctx.compress(streams[i]) for i in indices]

    if sum(len(s) for s in streams) < _PARALLEL_MIN_BYTES or len(streams) < 2 or _WORKERS < 2:
        return run(range(len(streams)))
    bounds = [len(streams) * k // _WORKERS for k in range(_WORKERS + 1)]
    futures = [_pool().submit(run, range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return [frame for future in futures for frame in future.result()]


def zstd_compress(data: bytes, level: int) -> bytes:
    """One zstd frame holding ``data`` at a plain zstd ``level`` (deterministic)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def zstd_decompress(frame: memoryview | bytes, size: int) -> bytes:
    """Decompress one frame that must hold exactly ``size`` bytes.

    Raises:
        CodecError: the frame is damaged or decodes to another size.
    """
    return _decompress_one((frame, size))


def _decompress_one(job: tuple[memoryview | bytes, int]) -> bytes:
    frame, size = job
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        # A ZstdDecompressor is not thread-safe: one per thread.
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    try:
        out = dctx.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CodecError(f"entropy-coded stream is corrupt: {e}") from e
    if len(out) != size:
        raise CodecError(f"entropy-coded stream decoded to {len(out)} bytes; {size} expected")
    return out


def _forget_pool() -> None:
    # A forked child inherits the pool object but not its threads: jobs would wait forever.
    global _POOL, _POOL_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="ragkv-codec")
        return _POOL


def decompress_streams(
    frames: Sequence[memoryview | bytes],
    sizes: Sequence[int],
    sink: Callable[[int, bytes], None],
) -> None:
    """Decompress each frame (which must hold exactly its size) and hand it to ``sink(index, data)``.

    zstd and numpy release the GIL, so large jobs run on a small shared thread pool, one batch
    of consecutive streams per worker (a task per stream cost more in hand-offs than it saved).
    ``sink`` runs on the worker threads and must only touch its own stream's output.

    Raises:
        CodecError: a frame is damaged or decodes to another size.
    """
    if len(frames) != len(sizes):
        raise CodecError(f"{len(frames)} coded streams for {len(sizes)} expected")

    def run(indices: range) -> None:
        for i in indices:
            sink(i, _decompress_one((frames[i], sizes[i])))

    pool = _pool()
    workers = _WORKERS
    if sum(sizes) < _PARALLEL_MIN_BYTES or len(frames) < 2 or workers < 2:
        run(range(len(frames)))
        return
    bounds = [len(frames) * k // workers for k in range(workers + 1)]
    for future in [pool.submit(run, range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]:
        future.result()
