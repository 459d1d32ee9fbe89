"""Salient-token precision in ``cachegen`` (format 3): finer steps where the saliency says, and
every way the new header fields can be wrong or old."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ragkv.codec.api as codec_api
from ragkv.codec import FORMAT_VERSION, decode, encode, read_header
from ragkv.codec.bitstream import pack, unpack
from ragkv.codec.cachegen import LEVELS
from ragkv.codec.saliency import normalized_attention, proxy_saliency
from ragkv.errors import CodecError
from ragkv.types import CodecSpec
from tests.codec.conftest import KEY, KVFactory, expected

SALIENT_LEVELS = [level for level, schedule in LEVELS.items() if schedule.salient_share > 0]
PLAIN_LEVEL = next(level for level, schedule in LEVELS.items() if schedule.salient_share == 0)


def test_some_level_keeps_salient_tokens() -> None:
    assert SALIENT_LEVELS, "no cachegen level uses salient tokens"


@pytest.mark.parametrize("level", SALIENT_LEVELS)
def test_the_callers_salient_tokens_are_coded_finer(make_kv: KVFactory, level: int) -> None:
    kv = make_kv(3, 2, 101, 16, dtype=torch.float32)
    saliency = torch.zeros(101)
    chosen = [5, 17, 18, 60, 99, 100][: max(1, round(LEVELS[level].salient_share * 100))]
    saliency[chosen] = 1.0 + torch.arange(len(chosen), dtype=torch.float32)
    data = encode(kv, CodecSpec("cachegen", level), key=KEY, saliency=saliency).data
    header = read_header(data)
    count = round(LEVELS[level].salient_share * 100)
    assert header.params["shift"] == LEVELS[level].salient_shift
    assert len(header.params["salient"]) == count
    assert set(i + 1 for i in header.params["salient"]) >= set(chosen[:count])  # indices skip the fp16 first token
    out = decode(data, expect=expected(kv, "cachegen", level))
    err = (out.values - kv.values).abs().amax(dim=(0, 1, 3))  # [tokens] worst error per token
    salient = torch.tensor([i + 1 for i in header.params["salient"]])
    rest = torch.ones(101, dtype=torch.bool)
    rest[salient] = False
    rest[0] = False
    assert float(err[salient].mean()) < 0.75 * float(err[rest].mean())


@pytest.mark.parametrize("level", SALIENT_LEVELS)
def test_without_saliency_a_proxy_picks_the_outlier_tokens(make_kv: KVFactory, level: int) -> None:
    kv = make_kv(2, 2, 64, 16, dtype=torch.float32)
    kv.keys[:, :, 40] *= 25.0  # one token far off every channel's spread
    header = read_header(encode(kv, CodecSpec("cachegen", level), key=KEY).data)
    assert 39 in header.params["salient"]
    assert int(proxy_saliency(kv.keys, kv.values).argmax()) == 40


@pytest.mark.parametrize("level", SALIENT_LEVELS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 1, 2, 4), (2, 2, 3, 8), (1, 1, 0, 4)])
def test_tiny_chunks_round_trip(make_kv: KVFactory, level: int, shape: tuple[int, int, int, int]) -> None:
    kv = make_kv(*shape, dtype=torch.float32)
    data = encode(kv, CodecSpec("cachegen", level), key=KEY, saliency=torch.rand(shape[2])).data
    out = decode(data, expect=expected(kv, "cachegen", level))
    assert out.keys.shape == kv.keys.shape
    if shape[2]:
        assert torch.allclose(out.keys[:, :, :1], kv.keys[:, :, :1].half().float())


def test_saliency_must_be_one_finite_score_per_token(make_kv: KVFactory) -> None:
    kv = make_kv(2, 1, 10, 4)
    spec = CodecSpec("cachegen", SALIENT_LEVELS[0])
    with pytest.raises(ValueError, match="one finite score per token"):
        encode(kv, spec, key=KEY, saliency=torch.ones(9))
    with pytest.raises(ValueError, match="one finite score per token"):
        encode(kv, spec, key=KEY, saliency=torch.full((10,), float("nan")))


def test_normalized_attention_divides_by_the_queries_that_see_a_token() -> None:
    # 4 tokens, uniform causal attention: token t gets 1/(q+1) from each query q >= t
    received = torch.tensor([1 + 1 / 2 + 1 / 3 + 1 / 4, 1 / 2 + 1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 4])
    score = normalized_attention({0: torch.cat([torch.tensor([9.0]), received])}, 4)  # a prefix slot first
    assert score.shape == (4,)
    assert bool((score[:-1] > score[1:]).all())  # early tokens are attended more per query here
    assert float(score.sum()) == pytest.approx(1.0)


def _salient_blob(make_kv: KVFactory) -> tuple[bytes, dict[str, object]]:
    kv = make_kv(2, 1, 40, 8)
    data = encode(kv, CodecSpec("cachegen", SALIENT_LEVELS[0]), key=KEY, saliency=torch.rand(40)).data
    return data, dict(read_header(data).params)


@pytest.mark.parametrize(
    "change",
    [
        {"shift": 0},
        {"shift": 5},
        {"shift": True},
        {"salient": []},
        {"salient": [3, 2]},
        {"salient": [1, 1]},
        {"salient": [-1]},
        {"salient": [39]},  # indices run over tokens 1..39, i.e. 0..38
        {"salient": ["1"]},
        {"salient": "1"},
        {"salient": None},
    ],
)
def test_malformed_salient_params_are_codec_errors(make_kv: KVFactory, change: dict[str, object]) -> None:
    data, params = _salient_blob(make_kv)
    header, sections = unpack(data)
    crafted = pack(dataclasses.replace(header, params={**params, **change}), [bytes(s) for s in sections])
    with pytest.raises(CodecError, match="salient"):
        decode(crafted, expect=None)


def test_salient_params_in_a_format_2_header_are_refused(make_kv: KVFactory) -> None:
    data, _ = _salient_blob(make_kv)
    header, sections = unpack(data)
    crafted = pack(dataclasses.replace(header, format_version=2), [bytes(s) for s in sections])
    with pytest.raises(CodecError, match="salient"):
        decode(crafted, expect=None)


@pytest.mark.parametrize("version", [2, 3])
def test_older_format_blobs_still_decode_bit_identically(
    make_kv: KVFactory, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    kv = make_kv(3, 2, 50, 16)
    spec = CodecSpec("cachegen", PLAIN_LEVEL)
    now = encode(kv, spec, key=KEY).data
    monkeypatch.setattr(codec_api, "FORMAT_VERSION", version)  # what a previous ragkv wrote
    old = encode(kv, spec, key=KEY).data
    monkeypatch.undo()
    assert read_header(old).format_version == version < read_header(now).format_version == FORMAT_VERSION
    expect = expected(kv, "cachegen", PLAIN_LEVEL)
    a, b = decode(old, expect=expect), decode(now, expect=expect)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_storage_key_changes_with_the_format_so_old_entries_are_misses() -> None:
    from ragkv.types import ChunkKey, ModelFingerprint, TokenizerFingerprint

    def key(version: int) -> str:
        return ChunkKey(
            model_fingerprint=ModelFingerprint("m"),
            tokenizer_fingerprint=TokenizerFingerprint("t"),
            prefix_digest="p",
            tokens_digest="d",
            codec=CodecSpec("cachegen", 0),
            format_version=version,
            tenant="default",
        ).storage_key

    assert key(2) != key(FORMAT_VERSION)
