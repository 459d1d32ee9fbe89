"""Decode speed of every cachegen level on one synthetic chunk of Qwen2.5-0.5B's shape (issue 26).

    python experiments/codec_decode_speed.py

24 layers, 2 KV heads, 500 tokens, 64 dims of Gaussian KV with a random saliency; each level is
encoded once and decoded 15 times to fp32 on the CPU, the fastest counts; the levels run twice,
interleaved, so that a noisy neighbour shows as disagreement between the two passes. Each level
is also decoded in a channel transform (a random orthonormal basis, keys rotated back with RoPE
frequencies, in the layers the Qwen calibration enabled: keys in all 24, values in 7): the cost of
the inverse transform.
"""

from __future__ import annotations

import time

import torch

from ragkv.codec import Expected, decode, encode
from ragkv.codec.cachegen import LEVELS
from ragkv.codec.transform import ChannelTransform
from ragkv.types import ChunkKV, CodecSpec, StorageKey

_KEY = StorageKey("0123456789abcdef/decode-speed")


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (24, 2, 500, 64)
    kv = ChunkKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(500), "m")
    saliency = torch.rand(500, generator=gen)
    basis, _ = torch.linalg.qr(torch.randn(2, 24, 2, 64, 64, generator=gen))
    freq = tuple(float(f) for f in 1.0 / 1e6 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    transform = ChannelTransform("m", basis, ((True,) * 24, (True,) * 7 + (False,) * 17), freq)
    for _ in range(2):
        for level in sorted(LEVELS):
            spec = CodecSpec("cachegen", level)
            for t in (None, transform):
                data = encode(kv, spec, key=_KEY, saliency=saliency, transform=t).data
                expect = Expected.of(kv, spec, _KEY)
                best = float("inf")
                for _ in range(15):
                    start = time.perf_counter()
                    decode(data, expect=expect, transform=t)
                    best = min(best, time.perf_counter() - start)
                name = "" if t is None else " +klt"
                print(f"level {level}{name}: {2 * kv.keys.numel() * 2 / best / 1e6:,.0f} MB/s", flush=True)


if __name__ == "__main__":
    main()
