"""The per-model channel transform (format 4): exact inversion, coding within a level's error
bound, calibration that enables it only where it pays, and a stored entry that is a miss
whenever it is not this model's sound transform."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragkv.codec import decode, encode, read_header
from ragkv.codec.bitstream import pack, unpack
from ragkv.codec.cachegen import STEPS, CacheGenCodec
from ragkv.codec.calibrate import calibrate, layer_savings, step_scales
from ragkv.codec.transform import ChannelTransform, load_transform, transform_blob, transform_key
from ragkv.errors import CodecError
from ragkv.types import ChunkKV, CodecSpec
from tests.codec.conftest import KEY, KVFactory, expected

SHAPE = (3, 2, 60, 16)  # [layers, heads, tokens, head_dim]


def _frequencies(head_dim: int) -> tuple[float, ...]:
    return tuple(float(f) for f in 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _random_transform(seed: int, enabled: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None) -> ChannelTransform:
    layers, heads, _, head_dim = SHAPE
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(2, layers, heads, head_dim, head_dim, generator=gen, dtype=torch.float64))
    flags = enabled or ((True, False, True), (False, True, True))
    return ChannelTransform("test", basis.float(), flags, _frequencies(head_dim))


def _correlated_kv(seed: int, start: int = 7) -> ChunkKV:
    """Keys and values whose channels are strongly correlated (a few latent directions, the same
    for every seed: one model), keys rotated by RoPE at their positions as a model's are; layer 2
    is white noise instead."""
    layers, heads, tokens, head_dim = SHAPE
    gen = torch.Generator().manual_seed(seed)
    mixes = torch.randn(2, layers, heads, 3, head_dim, generator=torch.Generator().manual_seed(0))
    out = []
    for mix in mixes:
        latent = torch.randn(layers, heads, tokens, 3, generator=gen) * 4
        x = latent @ mix + 0.05 * torch.randn(layers, heads, tokens, head_dim, generator=gen)
        x[2] = torch.randn(heads, tokens, head_dim, generator=gen)
        out.append(x)
    positions = torch.arange(start, start + tokens)
    rope = ChannelTransform(
        "test",
        torch.eye(head_dim).expand(2, layers, heads, head_dim, head_dim),
        ((True,) * layers, (True,) * layers),
        _frequencies(head_dim),
    )
    keys, _ = rope.inverse(out[0], out[1], positions)  # rotate forward: as RoPE left them
    return ChunkKV(keys, out[1], positions, "test")


def test_forward_then_inverse_is_the_identity(make_kv: KVFactory, seed: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32, start=1000)
    t = _random_transform(seed)
    k, v = t.forward(kv.keys, kv.values, kv.positions)
    k2, v2 = t.inverse(k, v, kv.positions)
    torch.testing.assert_close(k2, kv.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2, kv.values, atol=1e-5, rtol=1e-5)
    assert torch.equal(k[1], kv.keys[1]) and torch.equal(v[0], kv.values[0])  # layers not enabled pass through


def test_keys_are_rotated_back_as_the_explicit_rotation_matrix_says(make_kv: KVFactory) -> None:
    layers, heads, tokens, head_dim = SHAPE
    kv = make_kv(*SHAPE, dtype=torch.float32, start=300)
    eye = torch.eye(head_dim).expand(2, layers, heads, head_dim, head_dim)
    t = ChannelTransform("test", eye, ((True,) * layers, (False,) * layers), _frequencies(head_dim))
    got, _ = t.forward(kv.keys, kv.values, kv.positions)
    r = head_dim // 2
    for i, pos in enumerate(kv.positions.tolist()):  # the slow path: one 2x2 rotation per pair, fp64
        rot = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        for j, f in enumerate(_frequencies(head_dim)):
            angle = torch.tensor(pos * f, dtype=torch.float64)
            c, s = torch.cos(angle), torch.sin(angle)
            rot[j, j], rot[j, j + r], rot[j + r, j], rot[j + r, j + r] = c, s, -s, c  # by -angle
        want = kv.keys[:, :, i].double() @ rot.T
        torch.testing.assert_close(got[:, :, i].double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("level", CacheGenCodec.levels)
def test_coding_in_the_transform_stays_within_half_a_step(make_kv: KVFactory, seed: int, level: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32, start=50)
    t = _random_transform(seed)
    data = encode(kv, CodecSpec("cachegen", level), key=KEY, transform=t).data
    header, sections = unpack(data)
    assert header.params["transform"] == t.digest and header.format_version >= 4
    # the transformed tensors, as the plain quantizer's reference would reconstruct them
    z_hat = CacheGenCodec().decode(header, sections, torch.device("cpu"), torch.float32)
    z = t.forward(kv.keys, kv.values, kv.positions)
    layers, heads, tokens, head_dim = SHAPE
    codes = torch.from_numpy(STEPS[bytearray(_tables(sections[1], 2 * layers * heads * head_dim))].copy())
    step = codes.view(2, layers, heads, 1, head_dim)
    for kind in range(2):
        err = (z_hat[kind][:, :, 1:] - z[kind][:, :, 1:]).abs()
        assert bool((err <= step[kind] / 2 * (1 + 1e-5) + 1e-6).all())  # salient tokens: finer still
    out = decode(data, expect=expected(kv, "cachegen", level), transform=t)
    for x_hat, x, kind in ((out.keys, kv.keys, 0), (out.values, kv.values, 1)):
        # orthonormal per token: the error's norm per (token, head) is the transformed one's
        bound = (step[kind] / 2).pow(2).sum(dim=-1).sqrt()  # [L, H, 1]
        norm = (x_hat - x)[:, :, 1:].norm(dim=-1)
        assert bool((norm <= bound * (1 + 1e-4) + 1e-4).all())


def _tables(section: memoryview, count: int) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(bytes(section), max_output_size=3 * count)[:count]


def test_a_blob_coded_in_a_transform_decodes_only_with_it(make_kv: KVFactory, seed: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32)
    t = _random_transform(seed)
    data = encode(kv, CodecSpec("cachegen", 1), key=KEY, transform=t).data
    with pytest.raises(CodecError, match="channel transform"):
        decode(data, expect=expected(kv, "cachegen", 1))
    with pytest.raises(CodecError, match="channel transform"):
        decode(data, expect=expected(kv, "cachegen", 1), transform=_random_transform(seed + 1))
    plain = encode(kv, CodecSpec("cachegen", 1), key=KEY).data  # a transform given to a plain blob is unused
    assert torch.equal(decode(plain, expect=None, transform=t).keys, decode(plain, expect=None).keys)


def test_the_transform_parameter_is_refused_before_format_4(make_kv: KVFactory, seed: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32)
    t = _random_transform(seed)
    header, sections = unpack(encode(kv, CodecSpec("cachegen", 1), key=KEY, transform=t).data)
    crafted = pack(dataclasses.replace(header, format_version=3), [bytes(s) for s in sections])
    with pytest.raises(CodecError, match="malformed"):
        decode(crafted, expect=None, transform=t)


def test_a_transform_for_another_model_or_codec_is_refused_at_encode(make_kv: KVFactory, seed: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32)
    t = _random_transform(seed)
    other = ChunkKV(kv.keys, kv.values, kv.positions, "another-model")
    with pytest.raises(ValueError, match="calibrated for model"):
        encode(other, CodecSpec("cachegen", 1), key=KEY, transform=t)
    with pytest.raises(ValueError, match="cannot use a channel transform"):
        encode(kv, CodecSpec("int8", 0), key=KEY, transform=t)
    with pytest.raises(ValueError, match="shape"):
        encode(make_kv(2, 2, 10, 16), CodecSpec("cachegen", 1), key=KEY, transform=t)


def test_calibration_enables_the_basis_where_it_pays_and_not_on_white_noise(seed: int) -> None:
    calib = [_correlated_kv(seed + i, start=40 * i) for i in range(3)]
    t = calibrate(calib, inv_freq=_frequencies(SHAPE[3]))
    assert t.enabled == ((True, True, False), (True, True, False))
    gram = t.basis.transpose(3, 4) @ t.basis
    torch.testing.assert_close(gram, torch.eye(SHAPE[3]).expand_as(gram), atol=1e-5, rtol=0)
    savings = layer_savings(calib, t, level=1)
    assert min(savings[0][:2] + savings[1][:2]) > 0.1 and max(savings[0][2], savings[1][2]) < 0.03
    held_out = _correlated_kv(seed + 99, start=500)
    spec = CodecSpec("cachegen", 1)
    plain, coded = encode(held_out, spec, key=KEY).data, encode(held_out, spec, key=KEY, transform=t).data
    assert len(coded) < 0.9 * len(plain)
    err = [(decode(d, expect=None, transform=t).keys - held_out.keys).pow(2).mean() for d in (plain, coded)]
    assert err[1] <= err[0] * 1.05


# ---- the stored entry -------------------------------------------------------------------------


def test_the_stored_entry_round_trips(seed: int) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    t = dataclasses.replace(t, step_scales=((0.5, 1.0, 2.0), (1.25, 1.0, 0.8)))
    got = load_transform(transform_blob(t, key=key), key=key, model_fingerprint="test")
    assert got is not None and got.digest == t.digest and got.enabled == t.enabled and got.inv_freq == t.inv_freq
    assert got.step_scales == t.step_scales
    assert transform_key("tenant-b", "test") != key and transform_key("tenant-a", "other") != key


def test_an_entry_for_another_model_or_key_is_a_miss(seed: int) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    blob = transform_blob(t, key=key)
    assert load_transform(blob, key=key, model_fingerprint="another-model") is None
    assert load_transform(blob, key=transform_key("tenant-b", "test"), model_fingerprint="test") is None


def test_a_damaged_entry_is_a_miss(seed: int) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    blob = transform_blob(t, key=key)
    gen = torch.Generator().manual_seed(seed)
    for offset in torch.randint(0, len(blob), (40,), generator=gen).tolist():
        damaged = bytearray(blob)
        damaged[offset] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        assert load_transform(bytes(damaged), key=key, model_fingerprint="test") is None, offset
    assert load_transform(blob[:-9], key=key, model_fingerprint="test") is None


def test_an_entry_without_the_stores_tag_is_a_miss(seed: int) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    assert load_transform(transform_blob(t, key=key), key=key, model_fingerprint="test", secret=b"s" * 32) is None
    signed = transform_blob(t, key=key, secret=b"s" * 32)
    assert load_transform(signed, key=key, model_fingerprint="test", secret=b"s" * 32) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"params": {"enabled": [[1, 0, 1]], "inv_freq": [], "step_scales": []}},
        {"params": {"enabled": [[1, 0, 2], [0, 0, 0]], "inv_freq": [], "step_scales": []}},
        {"params": {"enabled": [[1, 0, 1], [0, 0, 0]], "inv_freq": ["x"], "step_scales": []}},
        {"params": {"enabled": [[1, 0, 1], [0, 0, 0]], "inv_freq": [], "step_scales": [[1.0] * 3, [-1.0] * 3]}},
        {"params": {"enabled": [[1, 0, 1], [0, 0, 0]], "inv_freq": []}},
        {"num_layers": 1 << 20},  # a shape its one section cannot hold: refused before allocating
        {"codec": "cachegen"},
    ],
)
def test_a_crafted_entry_is_a_miss(seed: int, change: dict[str, object]) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    header, sections = unpack(transform_blob(t, key=key))
    crafted = pack(dataclasses.replace(header, **change), [bytes(s) for s in sections])  # type: ignore[arg-type]
    assert load_transform(crafted, key=key, model_fingerprint="test") is None


def test_a_basis_that_is_not_orthonormal_is_a_miss(seed: int) -> None:
    t = _random_transform(seed)
    key = transform_key("tenant-a", "test")
    header, sections = unpack(transform_blob(t, key=key))
    scaled = (t.basis * 1.01).numpy().astype("<f4").tobytes()
    assert load_transform(pack(header, [scaled]), key=key, model_fingerprint="test") is None


def test_a_transform_entry_is_not_a_chunk(seed: int) -> None:
    key = transform_key("tenant-a", "test")
    blob = transform_blob(_random_transform(seed), key=key)
    assert read_header(blob).codec == "channel-transform"
    with pytest.raises(CodecError):
        decode(blob, expect=None)


def test_step_scales_follow_the_inverse_square_root_of_sensitivity() -> None:
    import doctest

    import ragkv.codec.calibrate
    import ragkv.codec.transform

    for module in (ragkv.codec.calibrate, ragkv.codec.transform):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0
    scales = step_scales([[1e-2, 1e-2, 4e-2], [0.0, 1e-2, 1e-2]], limit=4.0)
    flat = [v for row in scales for v in row]
    assert scales[0][2] == pytest.approx(scales[0][0] / 2)  # 4x the KL: half the step
    assert scales[1][0] == max(flat) <= 4.0  # a layer that never mattered: as coarse as allowed
    with pytest.raises(ValueError):
        step_scales([[float("nan")], [1.0]])


def test_step_scales_scale_the_encoders_steps(make_kv: KVFactory, seed: int) -> None:
    kv = make_kv(*SHAPE, dtype=torch.float32)
    plain = _random_transform(seed, enabled=((False,) * 3, (False,) * 3))
    coarse = dataclasses.replace(plain, step_scales=((2.0,) * 3, (2.0,) * 3))
    a, b = (encode(kv, CodecSpec("cachegen", 1), key=KEY, transform=t).data for t in (plain, coarse))
    assert len(b) < len(a)
    tables = [_tables(unpack(d)[1][1], 2 * 3 * 2 * 16) for d in (a, b)]
    assert all(y - x == 8 for x, y in zip(tables[0], tables[1], strict=True))  # one octave coarser everywhere
