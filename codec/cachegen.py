"""``cachegen``: CacheGen-style KV codec: layer-wise quantization and an entropy coder.

What it does, and why (every step was measured on and off; see the codec report in
docs/benchmarks.md):

- The first token of a chunk is stored as fp16. It is often an attention sink whose keys and
  values are far smaller than the rest; folded into shared statistics it ruins them.
- Every other value is uniformly quantized, ``q = round(x / step) - m``, where ``m`` is the
  channel's mean in steps (mean removal centres each channel's symbols, so one probability
  table fits a whole layer). Steps come from the data's spread and a per-level
  :class:`StepSchedule`: one step per layer for keys, one per channel for values, each depth
  third with its own multiplier.
- Step sizes are stored as 1/8-octave codes (one byte per channel), means as int16 step counts.
- Symbols of each (K/V, layer) form one stream, token-major ``[heads, tokens, head_dim]``, coded
  as one zstd frame (see ``_entropy``). Streams decode in parallel threads on the host;
  dequantization is one multiply, on the target device (off the CPU the int16 symbols are
  copied there from pinned memory, asynchronously).
- Token-delta coding was measured and left out (see ``code_streams``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
import zstandard

from ragkv.codec._entropy import compress_streams, decompress_streams, zstd_compress, zstd_decompress
from ragkv.codec._quant import pack_nibbles, unpack_nibbles
from ragkv.codec._tensors import from_section, staging, to_bytes, to_device, upload
from ragkv.codec.base import Codec
from ragkv.codec.header import BitstreamHeader
from ragkv.codec.payload import CodecPayload
from ragkv.codec.registry import register_codec
from ragkv.codec.saliency import proxy_saliency
from ragkv.codec.schedule import StepSchedule
from ragkv.codec.transform import ChannelTransform
from ragkv.errors import CodecError

__all__ = ["LEVELS", "STEPS", "CacheGenCodec", "channel_sigma", "code_streams", "quantize", "step_value"]

# Tuned on SmolLM2-135M (6 pydoc prompts, KL at the question and answer positions): values of
# the shallow third are the most sensitive, values of the deeper layers tolerate a step of about
# one sigma; keys share one multiplier (their per-layer sensitivity showed no depth trend).
LEVELS: dict[int, StepSchedule] = {
    0: StepSchedule(key_steps=(1 / 6, 1 / 6, 1 / 6), value_steps=(1 / 6, 1 / 3, 1 / 3)),  # near-lossless
    1: StepSchedule(key_steps=(0.4, 0.4, 0.4), value_steps=(1 / 4, 1.0, 1.0)),  # default
    2: StepSchedule(key_steps=(1 / 2, 1 / 2, 1 / 2), value_steps=(1 / 2, 1.5, 1.5)),
    3: StepSchedule(key_steps=(1.0, 1.0, 1.0), value_steps=(0.4, 2.0, 2.0)),  # aggressive
    # Salient tokens (format 3, ZipCache-style): the 10% of tokens with the most normalized
    # attention in their chunk's prefill keep a 2x finer step; the rest get level 1's (4) or level
    # 3's (5) steps x1.3. A 4x finer step cost more than it saved on held-out text; 2x finer, on
    # SmolLM2-135M packages prompts 0-1 (experiments/codec_salient.py): level 1 x1.3 is 3,976
    # bytes/token at KL 0.023 without, 4,206 at 0.013 with them (docs/benchmarks.md, issue 26).
    4: StepSchedule(key_steps=(0.5, 0.5, 0.5), value_steps=(1 / 3, 1.3, 1.3), salient_share=0.1, salient_shift=1),
    5: StepSchedule(key_steps=(1.3, 1.3, 1.3), value_steps=(0.5, 2.6, 2.6), salient_share=0.1, salient_shift=1),
}

_SIGMA_FLOOR = 1e-6  # channels that never vary still need a positive step
_CODE_BIAS = 128  # step = 2 ** ((code - 128) / 8): 2**-16 .. 2**16 in 1/8-octave steps
_CODE_PER_OCTAVE = 8
_SYMBOL_LIMIT = 32767  # symbols and means are int16; steps grow until they fit


@register_codec
class CacheGenCodec(Codec):
    """Layer-wise quantization with sigma-derived steps, entropy-coded with zstd.

    Sections: ``first`` fp16 ``[2, L, H, 1, D]`` (the first token's keys and values); ``tables``
    (zstd: step codes uint8 ``[2, L, H, D]`` then means int16 ``[2, L, H, D]``); then one zstd
    stream per (K/V, layer) holding ``[H, T - 1, D]`` symbols at ``params["bits"][i]`` bits each:
    4 (``q + 8`` packed two per byte, low nibble first), 8 (int8), or 16 (int16 as a low-byte
    plane then a high-byte plane).
    """

    name: ClassVar[str] = "cachegen"
    levels: ClassVar[tuple[int, ...]] = tuple(LEVELS)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, level: int) -> CodecPayload:
        return self.encode_salient(keys, values, level, None)

    def wants_saliency(self, level: int) -> bool:
        return LEVELS[level].salient_share > 0 and LEVELS[level].salient_shift > 0

    def encode_salient(
        self, keys: torch.Tensor, values: torch.Tensor, level: int, saliency: torch.Tensor | None
    ) -> CodecPayload:
        return self.encode_transformed(keys, values, level, saliency, None, None)

    def encode_transformed(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        level: int,
        saliency: torch.Tensor | None,
        transform: ChannelTransform | None,
        positions: torch.Tensor | None,
    ) -> CodecPayload:
        """Encode with keys and values in ``transform``'s space (see :mod:`ragkv.codec.transform`).

        Steps still come from the data's spread in the model's own channels, so a level means
        the same squared error with or without the basis (it is orthonormal): on a transformed
        layer every component of a head gets one step, the geometric mean of the steps its
        channels would get, and the bytes the basis saves are what it buys. Each layer's steps
        are then multiplied by the transform's calibrated ``step_scales`` (from the model's
        measured per-layer sensitivity). The decoder returns the transformed tensors;
        ``api.decode`` inverts the transform.
        """
        num_layers, _, num_tokens, _ = keys.shape
        if num_tokens == 0:
            return CodecPayload(sections=(), params={"bits": []})
        spaces = (
            (keys, values) if transform is None or positions is None else transform.forward(keys, values, positions)
        )
        first = to_bytes(torch.stack([spaces[0][:, :, :1], spaces[1][:, :, :1]]).half())
        if num_tokens == 1:
            return CodecPayload(sections=(first,), params={"bits": []})
        schedule = LEVELS[level]
        salient = _salient_tokens(keys, values, schedule, saliency)
        factor = torch.ones(num_tokens - 1)
        factor[salient] = float(1 << schedule.salient_shift)
        codes, means, frames, bits = [], [], [], []
        for kind, (x, relative, per_layer) in enumerate(
            ((keys, schedule.key_steps, True), (values, schedule.value_steps, False))
        ):
            sigma = channel_sigma(x[:, :, 1:].float(), per_layer)  # [L, H, 1, D], the model's channels
            if transform is not None:
                on = torch.tensor(transform.enabled[kind]).view(-1, 1, 1, 1)
                per_head = torch.exp(torch.log(sigma).mean(dim=3, keepdim=True)).expand_as(sigma)
                sigma = torch.where(on, per_head, sigma)
            rel = torch.tensor([relative[schedule.group(i, num_layers)] for i in range(num_layers)])
            if transform is not None:
                rel = rel * transform.scales(kind)
            y = spaces[kind][:, :, 1:].float()  # y: [L, H, T-1, D]
            code, mean, q = quantize(y, sigma * rel.view(-1, 1, 1, 1), factor.view(1, 1, -1, 1))
            codes.append(code)
            means.append(mean)
            layer_frames, layer_bits = code_streams(q, schedule.zstd_level)
            frames += layer_frames
            bits += layer_bits
        tables = to_bytes(torch.stack(codes)) + to_bytes(torch.stack(means))  # [2, L, H, D] each
        sections = (first, zstd_compress(tables, 19), *frames)
        params: dict[str, object] = {"bits": bits}
        if salient:
            params["salient"] = salient
            params["shift"] = schedule.salient_shift
        return CodecPayload(sections=sections, params=params)

    def check(self, header: BitstreamHeader) -> None:
        num_layers, heads, num_tokens, head_dim = header.shape
        bits = header.params.get("bits")
        expected_sections = 0 if num_tokens == 0 else (1 if num_tokens == 1 else 2 + 2 * num_layers)
        expected_streams = 0 if num_tokens < 2 else 2 * num_layers
        if (
            len(header.section_sizes) != expected_sections
            or not isinstance(bits, list)
            or len(bits) != expected_streams
            or not all(b in (4, 8, 16) and not isinstance(b, bool) for b in bits)
        ):
            raise CodecError("cachegen payload is malformed (sections or stream bit widths)")
        if num_tokens and header.section_sizes[0] != 2 * 2 * num_layers * heads * head_dim:  # fp16 first token
            raise CodecError(f"cachegen first-token section does not hold {header.shape}")
        _check_salient(header)

    def decode(
        self,
        header: BitstreamHeader,
        sections: Sequence[memoryview],
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_layers, heads, num_tokens, head_dim = header.shape
        bits = header.params["bits"]  # checked by check()
        # Every zstd frame must declare the size the shape implies before anything is allocated
        # for it: a frame of a few KB can legitimately expand to hundreds of MB.
        if num_tokens > 1:
            count = heads * (num_tokens - 1) * head_dim
            tables = 3 * 2 * num_layers * heads * head_dim  # uint8 step codes, int16 means
            _check_content_sizes(sections[1:], [tables] + [_stream_nbytes(b, count) for b in bits])
        # On CPU numpy dequantizes (3x faster than torch's mixed int16 * float32 multiply here);
        # elsewhere torch does it on the device.
        on_cpu = device.type == "cpu"
        work_dtype = torch.float32 if on_cpu else dtype
        out = torch.empty((2, num_layers, heads, num_tokens, head_dim), dtype=work_dtype, device=device)
        if num_tokens > 0:
            out[:, :, :, :1] = from_section(
                sections[0], torch.float16, (2, num_layers, heads, 1, head_dim), device, work_dtype
            )
        if num_tokens > 1:
            shape = (2, num_layers, heads, num_tokens - 1, head_dim)
            step, mean = _tables(sections[1], shape)
            salient, shift = _salient_params(header)
            if on_cpu:
                symbols = _symbols(sections[2:], bits, shape, mean, salient=salient, shift=shift)
                rest = out.numpy()[:, :, :, 1:]
                np.multiply(symbols, step, out=rest)
                if salient:
                    # salient tokens' symbols count steps 2**shift times finer (exact: a power of 2);
                    # numpy's fancy indexing: torch's index_put along a middle axis was 2x slower
                    index = np.asarray(salient, dtype=np.intp)
                    rest[:, :, :, index] *= np.float32(2.0**-shift)
            else:
                # the entropy stage writes the int16 symbols straight into pinned memory; they cross
                # as int16 (half of fp32's bytes) without a stream sync, and the multiply runs on
                # the device in fp32, as numpy's does, cast to ``dtype`` on write
                host = staging(shape, torch.int16, device)
                _symbols(sections[2:], bits, shape, mean, out=host.numpy(), salient=salient, shift=shift)
                torch.mul(upload(host, device), to_device(step, device), out=out[:, :, :, 1:])
                if salient:
                    where = torch.tensor(salient, device=device) + 1
                    out[:, :, :, where] *= 2.0**-shift
        if out.dtype != dtype:
            out = out.to(dtype)
        return out[0], out[1]


# step = 2 ** ((code - 128) / 8): one table, so encoder and decoder use bit-identical steps.
# The helpers below are the codec's stages, public for the code that calibrates steps or measures
# what a setting costs (codec.calibrate, retriever.transforms, ragkv.bench.codec): they must see
# exactly the steps and symbols the encoder writes.
STEPS = (2.0 ** ((np.arange(256) - _CODE_BIAS) / _CODE_PER_OCTAVE)).astype(np.float32)


def step_value(code: torch.Tensor) -> torch.Tensor:
    """Step sizes (fp32) of step ``code`` (any shape, int, 0..255): ``2 ** ((code - 128) / 8)``.

    >>> step_value(torch.tensor([128, 136])).tolist()
    [1.0, 2.0]
    """
    return torch.from_numpy(STEPS)[code.long()]


def channel_sigma(y: torch.Tensor, per_layer: bool) -> torch.Tensor:
    """Spread ``[L, H, 1, D]`` of ``y`` ``[L, H, N, D]`` over tokens, per channel (floored at 1e-6).

    With ``per_layer``, every channel of a layer gets the geometric mean of that layer's channel
    sigmas (one step per layer). A level's step for a channel is this spread times the level's
    relative step (``LEVELS``), as :meth:`CacheGenCodec.encode` computes it.
    """
    sigma = y.std(dim=2, correction=0, keepdim=True).clamp_min(_SIGMA_FLOOR)  # [L, H, 1, D]
    if per_layer:
        sigma = torch.exp(torch.log(sigma).mean(dim=(1, 3), keepdim=True)).expand_as(sigma)
    return sigma


def quantize(
    y: torch.Tensor, step_target: torch.Tensor, factor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``y`` ``[L, H, N, D]`` as the encoder does: step codes (uint8) and means (int16), both
    ``[L, H, D]``, and the symbols (int16, ``[L, H, N, D]``).

    ``step_target`` ``[L, H, 1, D]`` is each channel's wanted step (a spread times the level's
    relative step), rounded to the nearest 1/8-octave code. ``factor`` ``[1, 1, N, 1]`` (powers
    of 2) divides each token's step: a token with factor f is coded as
    ``round(y * f / step) - f * mean``, centred like the rest, f times finer.
    """
    if factor is None:
        factor = torch.ones(1, 1, y.shape[2], 1)
    target = torch.log2(step_target) * _CODE_PER_OCTAVE + _CODE_BIAS
    code = target.round().clamp(0, 255).to(torch.int32)
    mean_x = y.mean(dim=2, keepdim=True)
    while True:
        step = step_value(code)
        mean = torch.round(mean_x / step)
        total = torch.round(y * factor / step)
        q = total - mean * factor
        too_big = (
            (q.abs().amax(dim=(1, 2, 3)) > _SYMBOL_LIMIT)
            | (total.abs().amax(dim=(1, 2, 3)) > _SYMBOL_LIMIT)
            | ((mean.abs() * factor.max()).amax(dim=(1, 2, 3)) > _SYMBOL_LIMIT)
        )
        if not bool(too_big.any()):
            break
        if bool((code[too_big] >= 255).any()):
            raise ValueError("KV values are too large for the cachegen codec; use raw or int8")
        # Rare (outliers thousands of steps out): coarsen the offending layers one octave.
        code[too_big] = (code[too_big] + _CODE_PER_OCTAVE).clamp(max=255)
    return code.squeeze(2).to(torch.uint8), mean.squeeze(2).to(torch.int16), q.to(torch.int16)


def code_streams(q: torch.Tensor, zstd_level: int) -> tuple[list[bytes], list[int]]:
    """The encoder's entropy stage: per layer of ``q`` (int16 symbols, ``[L, H, N, D]``), the smallest
    zstd frame over the byte layouts the symbols fit, and its bits per symbol (the payload's size
    is the sum of the frames' lengths).

    Token deltas (``q[:, t] - q[:, t-1]``) were tried as further candidates: coding every stream
    as deltas cost 4-8% more bytes; picking them per stream saved 2.6% but doubled decode time
    (numpy's cumsum along tokens is 13x slower than the add it replaces), so they are left out.
    """
    symbols = q.numpy()
    candidates = [_symbol_layouts(symbols[layer]) for layer in range(q.shape[0])]
    coded = iter(compress_streams([data for layouts in candidates for data, _ in layouts], zstd_level))
    frames, bits = [], []
    for layouts in candidates:
        options = [(next(coded), nbits) for _, nbits in layouts]
        frame, nbits = min(options, key=lambda option: len(option[0]))
        frames.append(frame)
        bits.append(nbits)
    return frames, bits


def _symbol_layouts(q: np.ndarray) -> list[tuple[bytes, int]]:
    """The byte layouts one stream's symbols (int16) fit, with their bits per symbol.

    Nibble pairs pay at the coarse levels: zstd's Huffman coder cannot spend less than one bit
    on a byte, which costs 10-20% on streams under 2 bits/symbol; a byte holding two symbols
    halves that floor.
    """
    low, high = int(q.min()), int(q.max())
    if low >= -128 and high <= 127:
        out = [(q.astype(np.int8).tobytes(), 8)]
        if low >= -8 and high <= 7:
            out.append((pack_nibbles((q + 8).astype(np.uint8)).tobytes(), 4))
        return out
    planes = q.astype("<i2").view(np.uint8).reshape(-1, 2).T  # row 0: low bytes, row 1: high bytes
    return [(planes.tobytes(), 16)]


def _stream_nbytes(bits: int, count: int) -> int:
    return (count + 1) // 2 if bits == 4 else count * bits // 8


def _check_content_sizes(frames: Sequence[memoryview], sizes: Sequence[int]) -> None:
    """Refuse zstd frames that do not declare exactly ``sizes`` (read from their frame headers)."""
    for frame, size in zip(frames, sizes, strict=True):
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise CodecError(f"cachegen stream has no valid zstd frame header: {e}") from e
        if declared != size:
            raise CodecError(f"cachegen stream declares {declared} bytes; {size} expected")


def _tables(section: memoryview, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Steps (float32) and means (int16), both ``[2, L, H, 1, D]``, from the tables section."""
    two, num_layers, heads, _, head_dim = shape
    count = two * num_layers * heads * head_dim
    raw = zstd_decompress(section, 3 * count)
    table_shape = (two, num_layers, heads, 1, head_dim)
    step = STEPS[np.frombuffer(raw, dtype=np.uint8, count=count)].reshape(table_shape)
    mean = np.frombuffer(raw, dtype="<i2", offset=count).reshape(table_shape)
    return step, mean


def _symbols(
    frames: Sequence[memoryview],
    bits: Sequence[int],
    shape: tuple[int, ...],
    mean: np.ndarray,
    out: np.ndarray | None = None,
    salient: Sequence[int] = (),
    shift: int = 0,
) -> np.ndarray:
    """All streams' symbols plus their channel means: int16 ``[2, L, H, T-1, D]`` (into ``out`` if given).

    Adding the means in int16 while the streams are copied out of zstd is free; it leaves one
    float pass for dequantization. Salient tokens (indices along T-1) get ``2**shift`` times the
    mean: their symbols count finer steps, scaled back after the multiply. (Overflow only wraps: a
    crafted stream decodes to garbage, never to a crash, and the encoder keeps real sums within int16.)
    """
    two, num_layers, heads, tokens, head_dim = shape
    count = heads * tokens * head_dim
    if out is None:
        out = np.empty(shape, dtype=np.int16)
    out = out.reshape(two * num_layers, heads, tokens, head_dim)  # a view: ``out`` is written in place
    means = mean.reshape(two * num_layers, heads, 1, head_dim)
    index = np.asarray(salient, dtype=np.intp) if len(salient) else None

    def sink(i: int, data: bytes) -> None:
        offset = means[i]
        if bits[i] == 4:
            q: np.ndarray = unpack_nibbles(np.frombuffer(data, dtype=np.uint8), count)
            offset = offset - 8  # nibbles hold q + 8
        elif bits[i] == 8:
            q = np.frombuffer(data, dtype=np.int8)
        else:
            planes = np.frombuffer(data, dtype=np.uint8).reshape(2, count)
            q = np.empty(count, dtype=np.int16)
            q.view(np.uint8).reshape(count, 2)[:] = planes.T
        np.add(q.reshape(heads, tokens, head_dim), offset, out=out[i], casting="unsafe")
        if index is not None:
            extra = means[i] * ((1 << shift) - 1)
            out[i][:, index] += extra.astype(np.int16)

    decompress_streams(frames, [_stream_nbytes(b, count) for b in bits], sink)
    return out.reshape(shape)


def _salient_tokens(
    keys: torch.Tensor, values: torch.Tensor, schedule: StepSchedule, saliency: torch.Tensor | None
) -> list[int]:
    """Indices along tokens 1..T-1 (0-based there) of the level's share of most salient tokens, sorted."""
    rest = keys.shape[2] - 1
    count = min(rest, round(schedule.salient_share * rest)) if schedule.salient_shift else 0
    if count <= 0:
        return []
    score = saliency if saliency is not None else proxy_saliency(keys, values)
    top = torch.topk(score[1:].float(), count, sorted=False).indices  # the first token is fp16 already
    return sorted(int(i) for i in top)


def _check_salient(header: BitstreamHeader) -> None:
    """Refuse salient-token parameters that are malformed, or present before format 3."""
    params = header.params
    if "salient" not in params and "shift" not in params:
        return
    salient, shift = params.get("salient"), params.get("shift")
    rest = header.num_tokens - 1
    if (
        header.format_version < 3
        or not isinstance(shift, int)
        or isinstance(shift, bool)
        or not 1 <= shift <= 4
        or not isinstance(salient, list)
        or not 0 < len(salient) <= max(0, rest)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in salient)
        or salient[0] < 0
        or salient[-1] >= rest
        or any(b <= a for a, b in zip(salient, salient[1:], strict=False))
    ):
        raise CodecError("cachegen salient-token parameters are malformed")


def _salient_params(header: BitstreamHeader) -> tuple[list[int], int]:
    """The salient token indices and the shift (checked by ``_check_salient``); none: ``([], 0)``."""
    if "salient" not in header.params:
        return [], 0
    return list(header.params["salient"]), int(header.params["shift"])
