"""The entropy stage codes close to the empirical entropy of the quantized symbols."""

from __future__ import annotations

import numpy as np
import torch

from ragkv.codec import read_header
from ragkv.codec.cachegen import LEVELS, channel_sigma, quantize
from tests.codec.conftest import KVFactory, encoded


def _entropy_bytes(symbols: torch.Tensor) -> tuple[float, float]:
    """(the order-0 entropy of ``symbols`` in bytes, Huffman's worst loss over it in bytes).

    A Huffman code loses less than ``p_max + 0.086`` bits per symbol against the entropy, where
    ``p_max`` is the likeliest symbol's probability (Gallager, 1978): at the coarse levels most
    symbols are 0, and the loss is a large share of a small entropy.
    """
    _, counts = np.unique(symbols.numpy(), return_counts=True)
    p = counts / counts.sum()
    n = symbols.numel()
    return float(-(p * np.log2(p)).sum() * n / 8), float((p.max() + 0.086) * n / 8)


def test_stream_sizes_track_the_symbol_entropy(make_kv: KVFactory) -> None:
    layers = 4
    kv = make_kv(layers, 2, 400, 32, dtype=torch.float32)
    for level, schedule in LEVELS.items():
        header = read_header(encoded(kv, "cachegen", level))
        coded = header.section_sizes[2:]
        factor = torch.ones(1, 1, 399, 1)  # salient tokens' steps are 2**shift finer
        factor[:, :, list(header.params.get("salient", [])), :] = float(1 << header.params.get("shift", 0))
        ideal = []
        for x, rel, per_layer in ((kv.keys, schedule.key_steps, True), (kv.values, schedule.value_steps, False)):
            mult = torch.tensor([rel[schedule.group(i, layers)] for i in range(layers)]).view(-1, 1, 1, 1)
            y = x[:, :, 1:].float()
            _, _, q = quantize(y, channel_sigma(y, per_layer) * mult, factor)
            ideal += [_entropy_bytes(q[i]) for i in range(layers)]
        for got, (want, loss) in zip(coded, ideal, strict=True):
            # zstd's frame and Huffman table cost tens of bytes, and a Huffman code loses up to
            # `loss` (at the coarse levels: seed 3201331038 lost 7.8% of the entropy, 179146907
            # 11.5%); a broken table or layout shows up as a far larger excess (raw int8 is 8 bits
            # a symbol)
            assert 0.9 * want <= got <= want + loss + 80, (level, got, want, loss)
