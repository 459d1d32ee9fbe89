"""Round trips of every codec: exactness for raw, error bounds for the lossy ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ragkv.codec import available_codecs, decode, encode
from ragkv.codec._tensors import dequantize, dequantize_on
from ragkv.codec.cachegen import LEVELS
from ragkv.types import CodecSpec
from tests.codec.conftest import KEY, KVFactory, encoded, expected, roundtrip

SHAPES = [(4, 2, 37, 16), (1, 1, 1, 1), (3, 2, 0, 8), (2, 3, 5, 7), (1, 1, 2, 3), (2, 1, 130, 64)]
ALL = [(name, level) for name, levels in available_codecs().items() for level in levels]


@pytest.mark.parametrize("shape", SHAPES)
def test_raw_is_bit_exact_for_fp16(make_kv: KVFactory, shape: tuple[int, int, int, int]) -> None:
    kv = make_kv(*shape)
    out = roundtrip(kv, "raw", dtype=torch.float16)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)
    assert torch.equal(out.positions, kv.positions)
    assert out.model_fingerprint == "test"


@pytest.mark.parametrize(("name", "level"), ALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_codec_round_trips_shapes(
    make_kv: KVFactory, name: str, level: int, shape: tuple[int, int, int, int]
) -> None:
    kv = make_kv(*shape, start=11)
    enc = encode(kv, CodecSpec(name, level), key=KEY)
    assert (enc.spec, enc.num_tokens) == (CodecSpec(name, level), shape[2])
    out = decode(enc.data, expect=expected(kv, name, level))
    assert out.keys.shape == kv.keys.shape and out.values.shape == kv.values.shape
    assert out.keys.dtype == torch.float32
    assert torch.equal(out.positions, kv.positions)
    assert bool(torch.isfinite(out.keys).all() and torch.isfinite(out.values).all())


def _max_abs_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs()


def test_int8_error_is_half_a_step(make_kv: KVFactory) -> None:
    kv = make_kv(4, 2, 37, 16, dtype=torch.float32)
    out = roundtrip(kv, "int8")
    for x, y in ((kv.keys, out.keys), (kv.values, out.values)):
        step = x.abs().amax(-1, keepdim=True) / 127
        assert bool((_max_abs_err(x, y) <= step * 0.5 * 1.01 + 1e-6).all())


def test_int4_error_is_half_a_group_step(make_kv: KVFactory) -> None:
    kv = make_kv(2, 2, 100, 16, dtype=torch.float32)
    out = roundtrip(kv, "int4")
    # keys: per channel over token groups of 64; values: per token over channel groups.
    k_span = torch.cat(
        [
            kv.keys[:, :, :64].amax(2, keepdim=True) - kv.keys[:, :, :64].amin(2, keepdim=True),
            kv.keys[:, :, 64:].amax(2, keepdim=True) - kv.keys[:, :, 64:].amin(2, keepdim=True),
        ],
        2,
    )
    k_bound = torch.repeat_interleave(k_span, torch.tensor([64, 36]), dim=2) / 15 * 0.5 * 1.01 + 1e-3
    assert bool((_max_abs_err(kv.keys, out.keys) <= k_bound).all())
    v_span = kv.values.amax(-1, keepdim=True) - kv.values.amin(-1, keepdim=True)
    assert bool((_max_abs_err(kv.values, out.values) <= v_span / 15 * 0.5 * 1.01 + 1e-3).all())


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_cachegen_error_is_half_a_step(make_kv: KVFactory, level: int) -> None:
    layers = 6
    kv = make_kv(layers, 2, 50, 16, dtype=torch.float32)
    out = roundtrip(kv, "cachegen", level)
    schedule = LEVELS[level]
    slack = 2 ** (1 / 16) * 0.5 * 1.001  # step codes round to 1/8 octave
    for x, y, rel, per_layer in (
        (kv.keys, out.keys, schedule.key_steps, True),
        (kv.values, out.values, schedule.value_steps, False),
    ):
        # first token: stored as fp16
        assert bool((_max_abs_err(x[:, :, :1], y[:, :, :1]) <= x[:, :, :1].abs() * 2**-10 + 1e-7).all())
        sigma = x[:, :, 1:].std(2, correction=0, keepdim=True)
        if per_layer:
            sigma = torch.exp(torch.log(sigma).mean((1, 3), keepdim=True))
        mult = torch.tensor([rel[schedule.group(i, layers)] for i in range(layers)]).view(-1, 1, 1, 1)
        bound = sigma * mult * slack + 1e-5
        assert bool((_max_abs_err(x[:, :, 1:], y[:, :, 1:]) <= bound).all())


@pytest.mark.parametrize("salient", [False, True])
def test_cachegen_levels_trade_bytes_for_error(make_kv: KVFactory, salient: bool) -> None:
    # the plain levels 0-3 form one ladder, the salient-token levels another
    kv = make_kv(6, 2, 120, 32, dtype=torch.float32)
    sizes, errors = [], []
    for level in sorted(k for k, s in LEVELS.items() if (s.salient_share > 0) == salient):
        enc = encode(kv, CodecSpec("cachegen", level), key=KEY)
        out = decode(enc.data, expect=expected(kv, "cachegen", level))
        sizes.append(enc.nbytes)
        errors.append(float(torch.mean((out.values - kv.values) ** 2 + (out.keys - kv.keys) ** 2)))
    assert sizes == sorted(sizes, reverse=True)
    assert errors == sorted(errors)
    assert sizes[0] < len(encoded(kv, "int8"))


def test_cachegen_keeps_outliers_via_wide_symbols() -> None:
    keys = torch.randn(2, 1, 40, 8)
    keys[1, 0, 7, 3] = 3000.0  # thousands of steps out: needs int16 symbols
    kv_values = torch.randn(2, 1, 40, 8)
    from ragkv.types import ChunkKV

    kv = ChunkKV(keys, kv_values, torch.arange(40), "test")
    out = roundtrip(kv, "cachegen", 0)
    assert abs(float(out.keys[1, 0, 7, 3]) - 3000.0) < 3000.0 * 0.05
    assert float((out.keys - keys).abs()[0].max()) < 0.2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(available_codecs()))
def test_decode_to_dtype_and_device(make_kv: KVFactory, dtype: torch.dtype, name: str) -> None:
    kv = make_kv(2, 2, 9, 8)
    data = encoded(kv, name)
    ref = decode(data, expect=expected(kv, name))
    for device in ("cpu", torch.device("cpu")):
        out = decode(data, expect=expected(kv, name), device=device, dtype=dtype)
        assert out.keys.dtype == dtype and out.values.dtype == dtype
        assert out.keys.device.type == "cpu" and out.positions.dtype == torch.int64
        tol = 1e-2 * float(ref.keys.abs().max())
        assert torch.allclose(out.keys.float(), ref.keys, atol=tol)
        assert torch.allclose(out.values.float(), ref.values, atol=tol)


@pytest.mark.parametrize("name", sorted(available_codecs()))
def test_device_path_runs_off_cpu(make_kv: KVFactory, name: str) -> None:
    """The meta device exercises the non-CPU (torch) dequantization path without a GPU."""
    kv = make_kv(2, 2, 9, 8)
    out = roundtrip(kv, name, device="meta", dtype=torch.float16)
    assert out.keys.device.type == "meta" and out.keys.shape == kv.keys.shape
    assert out.values.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [False, True], ids=["int8-like", "int4-like"])
def test_the_device_dequantization_equals_the_host_one_bit_for_bit(dtype: torch.dtype, offset: bool) -> None:
    """The torch half that runs on a GPU computes in fp32 like numpy, so a device decode is the host decode moved."""
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(3, 2, 40, 16)).astype(np.int8)
    scale = rng.lognormal(-4, 2, size=(3, 2, 40, 1)).astype(np.float16).astype(np.float32)
    low = rng.normal(0, 3, size=(3, 2, 40, 1)).astype(np.float32) if offset else None
    host = dequantize(q, scale, low, torch.device("cpu"), dtype)
    on_device = dequantize_on(
        torch.from_numpy(q), torch.from_numpy(scale), None if low is None else torch.from_numpy(low), dtype
    )
    assert on_device.dtype == dtype and torch.equal(on_device, host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "level"), ALL)
def test_cuda_decode_equals_the_cpu_decode_moved_to_cuda(
    make_kv: KVFactory, name: str, level: int, dtype: torch.dtype
) -> None:
    """Bit for bit: the device multiplies in fp32 like the host, and casts round the same way."""
    kv = make_kv(4, 2, 37, 16)
    data = encoded(kv, name, level)
    cpu = decode(data, expect=expected(kv, name, level), dtype=dtype)
    gpu = decode(data, expect=expected(kv, name, level), device="cuda", dtype=dtype)
    assert gpu.keys.is_cuda and gpu.values.is_cuda and gpu.keys.dtype == dtype
    assert torch.equal(gpu.keys.cpu(), cpu.keys) and torch.equal(gpu.values.cpu(), cpu.values)
    assert torch.equal(gpu.positions, cpu.positions) and gpu.positions.device.type == "cpu"


@pytest.mark.parametrize(("name", "level"), ALL)
def test_encoding_is_deterministic(make_kv: KVFactory, name: str, level: int) -> None:
    kv = make_kv(3, 2, 41, 16, dtype=torch.float32)
    assert encoded(kv, name, level) == encoded(kv, name, level)


def test_non_contiguous_positions_round_trip(make_kv: KVFactory) -> None:
    kv = make_kv(2, 1, 6, 4)
    positions = torch.tensor([0, 1, 2, 10, 11, 40])
    from ragkv.types import ChunkKV

    kv = ChunkKV(kv.keys, kv.values, positions, "test")
    assert torch.equal(roundtrip(kv, "cachegen").positions, positions)


def test_bfloat16_and_wide_inputs_encode(make_kv: KVFactory) -> None:
    kv = make_kv(2, 2, 10, 8, dtype=torch.bfloat16)
    out = roundtrip(kv, "raw", dtype=torch.bfloat16)
    assert torch.allclose(out.keys.float(), kv.keys.float(), atol=math.ldexp(1, -6))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_decode_works_in_a_forked_child(make_kv: KVFactory) -> None:
    import os

    kv = make_kv(4, 2, 400, 64, dtype=torch.float32)
    data = encoded(kv, "cachegen")
    decode(data, expect=expected(kv, "cachegen"))  # starts the decode thread pool in the parent
    pid = os.fork()
    if pid == 0:  # child: must not hang on the parent's dead pool threads
        try:
            decode(data, expect=expected(kv, "cachegen"))
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_raw_view_on_the_host_is_the_stored_fp16_without_a_copy():
    from ragkv import codec as api
    from ragkv.types import ChunkKV, CodecSpec, StorageKey

    k = torch.randn(2, 2, 5, 4)
    kv = ChunkKV(k, k * 2, torch.arange(5), "m")
    data = api.encode(kv, CodecSpec("raw", 0), key=StorageKey("bench/k")).data
    viewed = api.decode(data, expect=None, view=True)
    copied = api.decode(data, expect=None, dtype=torch.float16)
    assert viewed.keys.dtype == torch.float16 and torch.equal(viewed.keys, copied.keys)
    assert torch.equal(viewed.values, copied.values)
    assert torch.equal(api.decode(data, expect=None, dtype=torch.float32, view=False).keys, copied.keys.float())
