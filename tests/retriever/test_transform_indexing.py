"""The channel transform on the index and query paths (issue 26): calibrated once and stored, chunks
coded in it under keys that digest it, and a missing, damaged or foreign transform entry a miss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ragkv.codec import read_header
from ragkv.codec.transform import ChannelTransform, load_transform, transform_blob, transform_key
from ragkv.digests import fields_digest
from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.retriever.transforms import UNCALIBRATED, TransformConfig
from ragkv.types import ChunkKey, CodecSpec, ModelFingerprint, TokenizerFingerprint

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards; they are red or green and sweet. " * 3, "apples"),
    Document("mem:boats", "Boats float on water and carry people across the lake to islands. " * 3, "boats"),
    Document("mem:clocks", "Clocks count the hours with gears and springs, ticking on the wall. " * 3, "clocks"),
]
QUESTION = "What grows on trees, and what floats?"
GEN = GenerationConfig(max_new_tokens=8)
LEVEL1 = CodecSpec("cachegen", 1)
ON, OFF = TransformConfig(), TransformConfig(levels=())


def _engine(tmp_path: Path, adapter, transform: TransformConfig = ON, codec: CodecSpec = LEVEL1, **kw) -> RagKV:
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=RetrieverConfig(
            top_k=3, chunker=ChunkerConfig(min_tokens=40, max_tokens=400), codec=codec, transform=transform
        ),
        store=("memory://", str(tmp_path / "kv")),
        **kw,
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _stored_transform(rag: RagKV) -> ChannelTransform | None:
    key = transform_key(rag.retriever.tenant, rag.adapter.fingerprint)
    data = rag.store.get(key)
    return None if data is None else load_transform(data, key=key, model_fingerprint=rag.adapter.fingerprint)


def _chunks(rag: RagKV):
    return sorted(rag.retrieve("apples boats clocks", k=5), key=lambda c: c.source)


# ---- settings and keys ------------------------------------------------------------------------
def test_transform_applies_from_its_level_to_codecs_that_can_code_in_it():
    assert [ON.applies(CodecSpec("cachegen", v)) for v in range(6)] == [False, True, True, False, False, False]
    assert not ON.applies(CodecSpec("int8", 0)) and not TransformConfig(levels=(0,)).applies(CodecSpec("int4", 0))
    assert TransformConfig(levels=(0,)).applies(CodecSpec("cachegen", 0)) and not OFF.applies(LEVEL1)
    for bad in ((-1,), [1], (True,)):
        with pytest.raises(ValueError, match="levels"):
            TransformConfig(levels=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calibration_tokens"):
        TransformConfig(calibration_tokens=4)
    with pytest.raises(TypeError, match="TransformConfig"):
        RetrieverConfig(transform=1)  # type: ignore[arg-type]


def test_chunk_key_digests_the_transform_and_keeps_the_old_digest_without_one():
    base = ChunkKey(ModelFingerprint("m"), TokenizerFingerprint("t"), "p", "k", LEVEL1, 4, "team")
    legacy = fields_digest(  # the fields every key digested before the transform existed
        [
            ("model", "m"),
            ("tokenizer", "t"),
            ("prefix", "p"),
            ("tokens", "k"),
            ("codec", "cachegen"),
            ("level", 1),
            ("format", 4),
            ("tenant", "team"),
        ]  # fmt: skip
    )
    assert base.digest == legacy
    a, b = (dataclasses.replace(base, transform_digest=d) for d in ("a" * 64, "b" * 64))
    assert len({base.digest, a.digest, b.digest}) == 3 and a.namespace == base.namespace


# ---- indexing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sensitivity", [False, True])
def test_indexing_calibrates_once_stores_the_transform_and_codes_chunks_in_it(tmp_path, llama_adapter, sensitivity):
    with _engine(tmp_path, llama_adapter, transform=TransformConfig(sensitivity=sensitivity)) as rag:
        report = rag.index(DOCS, progress=False)
        transform = _stored_transform(rag)
        assert transform is not None and bool(transform.step_scales) == sensitivity  # steps from measured KL
        assert transform.model_fingerprint == llama_adapter.fingerprint
        for chunk in _chunks(rag):
            key = rag.retriever.computer.chunk_key(chunk.token_ids, LEVEL1)
            assert key.transform_digest == transform.digest
            header = read_header(rag.store.get(key.storage_key))
            assert header.params["transform"] == transform.digest
        assert report.computed == 3 and report.bytes_stored > 0
    with _engine(tmp_path, llama_adapter) as again:  # a new process reads it: nothing recalibrated or recomputed
        assert again.index(DOCS, progress=False).unchanged == 3
        assert again.retriever.computer.transforms.current().digest == transform.digest


def test_transform_off_and_level_0_store_plain_chunks_under_the_old_keys(tmp_path, llama_adapter):
    for sub, transform, codec in (("off", OFF, LEVEL1), ("level0", ON, CodecSpec("cachegen", 0))):
        with _engine(tmp_path / sub, llama_adapter, transform=transform, codec=codec) as rag:
            rag.index(DOCS, progress=False)
            assert _stored_transform(rag) is None  # nothing calibrated
            key = rag.retriever.computer.chunk_key(_chunks(rag)[0].token_ids, codec)
            assert key.transform_digest == ""
            assert "transform" not in read_header(rag.store.get(key.storage_key)).params


def test_answers_match_transform_off_exactly_at_full_recompute_and_closely_by_default(tmp_path, llama_adapter):
    answers, errors = {}, {}
    for name, transform in (("on", ON), ("off", OFF)):
        with _engine(tmp_path / name, llama_adapter, transform=transform) as rag:
            rag.index(DOCS, progress=False)
            chunks = _chunks(rag)
            full = rag.answer(QUESTION, chunks=chunks, generation=GEN, fusion=FusionConfig(method="full", ratio=1.0))
            default = rag.answer(QUESTION, chunks=chunks, generation=GEN)
            assert default.stats.cache_hits == 3 and default.stats.cache_misses == 0
            answers[name] = (full.text, default.text)
            prefix = rag.retriever.computer.prefix_kv()
            err = 0.0
            for c in chunks:
                exact = llama_adapter.prefill_kv(c.token_ids, past=[prefix])
                loaded = rag.retriever.loader.load(c.token_ids)
                assert loaded.hit
                for got, want in ((loaded.kv.keys, exact.keys), (loaded.kv.values, exact.values)):
                    err = max(err, float((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()))
            errors[name] = err
    assert answers["on"][0] == answers["off"][0]  # full recompute: the stored bytes do not matter
    assert answers["on"][1] == answers["off"][1]
    # the decoded KV stays close to the exact one (random weights: the basis and the steps from
    # measured sensitivity do not pay here, they move error between layers)
    assert errors["off"] < errors["on"] < 0.05, errors


# ---- bad transform entries: a miss for the chunks coded in it, never a wrong answer -------------
def _bad_entry(rag: RagKV, case: str) -> None:
    key = transform_key(rag.retriever.tenant, rag.adapter.fingerprint)
    good, sound = rag.store.get(key), _stored_transform(rag)
    assert good is not None and sound is not None
    rag.store.invalidate(key)
    if case == "damaged":
        blob = bytearray(good)
        blob[len(blob) // 2] ^= 0x40
        rag.store.put(key, bytes(blob))
    elif case == "foreign":  # a sound transform of another model, under this model's key
        rag.store.put(key, transform_blob(dataclasses.replace(sound, model_fingerprint="another-model"), key=key))


@pytest.mark.parametrize("case", ["missing", "damaged", "foreign"])
def test_a_bad_transform_entry_makes_its_chunks_misses_recomputed_and_stored_again(tmp_path, llama_adapter, case):
    full = FusionConfig(method="full", ratio=1.0)
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)
        old = _stored_transform(rag)
        chunks = _chunks(rag)[:2]  # the recalibration sees these two only: another transform
        clean = rag.answer(QUESTION, chunks=chunks, generation=GEN, fusion=full).text
        _bad_entry(rag, case)
    assert old is not None
    with _engine(tmp_path, llama_adapter) as rag:  # a new process: its transform comes from the store
        ids = [c.token_ids for c in chunks]
        assert [got.hit for got in rag.retriever.loader.load_many(ids)] == [False, False]  # recomputed and stored
        new = _stored_transform(rag)  # recalibrated from the chunks at hand, and stored
        assert new is not None and new.digest != old.digest
        assert rag.retriever.computer.transforms.current().digest == new.digest
        assert [got.hit for got in rag.retriever.loader.load_many(ids)] == [True, True]
        assert rag.answer(QUESTION, chunks=chunks, generation=GEN, fusion=full).text == clean
        for c in chunks:
            key = rag.retriever.computer.chunk_key(c.token_ids, LEVEL1)
            assert key.transform_digest == new.digest
            assert read_header(rag.store.get(key.storage_key)).params["transform"] == new.digest


def test_a_chunk_coded_in_another_transform_is_never_decoded(tmp_path, llama_adapter):
    """A blob coded in transform A stored under the key of transform B is refused (a miss), not decoded with B."""
    with _engine(tmp_path, llama_adapter) as rag:
        rag.index(DOCS, progress=False)
        chunk = _chunks(rag)[0]
        source = rag.retriever.computer.transforms
        mine = source.current()
        layers = mine.shape[0]
        theirs = dataclasses.replace(mine, step_scales=((1.5,) * layers, (1.0,) * layers))  # another one, same model
        key = rag.retriever.computer.chunk_key(chunk.token_ids, LEVEL1)
        exact = llama_adapter.prefill_kv(chunk.token_ids, past=[rag.retriever.computer.prefix_kv()])
        from ragkv import codec

        foreign = codec.encode(exact, LEVEL1, key=key.storage_key, transform=theirs).data
        rag.store.invalidate(key.storage_key)
        rag.store.put(key.storage_key, foreign)
        loaded = rag.retriever.loader.load(chunk.token_ids)
        assert not loaded.hit  # refused, recomputed, stored again in this process's transform
        assert read_header(rag.store.get(key.storage_key)).params["transform"] == source.current().digest
        assert torch.equal(loaded.kv.keys, exact.keys)


def test_keys_made_before_any_transform_exists_always_miss(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        key = rag.retriever.computer.chunk_key((1, 2, 3), LEVEL1)  # nothing indexed: no transform yet
        assert key.transform_digest == UNCALIBRATED and not rag.store.contains(key.storage_key)


def test_with_a_store_secret_an_unsigned_transform_entry_is_a_miss(tmp_path, llama_adapter):
    secret = b"a deployment secret of 32 bytes!"
    with _engine(tmp_path, llama_adapter, store_secret=secret) as rag:
        rag.index(DOCS, progress=False)
        key = transform_key(rag.retriever.tenant, rag.adapter.fingerprint)
        signed = rag.store.get(key)
        sound = load_transform(signed, key=key, model_fingerprint=rag.adapter.fingerprint, secret=secret)
        assert sound is not None  # signed with the store secret
        chunks = _chunks(rag)[:2]
        rag.store.invalidate(key)
        rag.store.put(key, transform_blob(sound, key=key))  # the same transform, unsigned
    with _engine(tmp_path, llama_adapter, store_secret=secret) as rag:
        assert [got.hit for got in rag.retriever.loader.load_many([c.token_ids for c in chunks])] == [False, False]
        assert rag.retriever.computer.transforms.current().digest != sound.digest
