"""A valid entry under the wrong key is a miss: swapped, cross-tenant, other-codec and unsigned blobs
are refused, recomputed and replaced, and the answer is the clean one."""

from __future__ import annotations

from pathlib import Path

from ragkv.engine import EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import Chunk, CodecSpec

_APPLES = "Apples grow on trees in orchards; they are red or green and sweet. " * 3
_BOATS = ("Boats float on water and carry people across the lake to islands. " * 4)[: len(_APPLES.strip())]
# one chunk per document, two chunks of the same length (the byte-level test tokenizer: one token per byte)
DOCS = [Document("mem:apples", _APPLES, "apples"), Document("mem:boats", _BOATS, "boats")]
QUESTION = "What grows on trees, and what floats?"
GEN = GenerationConfig(max_new_tokens=8)
CACHEGEN, INT4 = CodecSpec("cachegen", 0), CodecSpec("int4", 0)
SECRET = b"a deployment secret of 32 bytes!"


def _engine(tmp_path: Path, adapter, **kw) -> RagKV:
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=RetrieverConfig(
            top_k=2,
            chunker=ChunkerConfig(min_tokens=40, max_tokens=400),
            codec=CACHEGEN,
            index_codecs=(INT4,),
        ),
        store=("memory://", str(tmp_path / "kv")),
        **kw,
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _chunks(rag: RagKV) -> tuple[Chunk, Chunk]:
    rag.index(DOCS, progress=False)
    by_source = {c.source: c for c in rag.retrieve("apples boats", k=5)}
    apples, boats = by_source["mem:apples"], by_source["mem:boats"]
    assert len(apples.token_ids) == len(boats.token_ids) and apples.token_ids != boats.token_ids
    return apples, boats


def _replace(rag: RagKV, key: str, blob: bytes) -> None:
    """Store ``blob`` under ``key`` in every tier, as a writer to a shared tier could."""
    rag.store.invalidate(key)
    rag.store.put(key, blob)


def test_swapped_blobs_of_same_length_chunks_are_misses(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        apples, boats = _chunks(rag)
        clean = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert clean.stats.cache_hits == 2
        key_a, key_b = (rag.retriever.computer.chunk_key(c.token_ids, CACHEGEN).storage_key for c in (apples, boats))
        blob_a, blob_b = rag.store.get(key_a), rag.store.get(key_b)
        _replace(rag, key_a, blob_b)
        _replace(rag, key_b, blob_a)
        swapped = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert swapped.stats.cache_misses == 2 and swapped.stats.cache_hits == 0
        assert swapped.text == clean.text and swapped.stats.generated_tokens == clean.stats.generated_tokens
        assert rag.store.get(key_a) != blob_b  # recomputed and stored again: the next answer hits
        healed = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert healed.stats.cache_hits == 2 and healed.text == clean.text


def test_another_tenants_blob_under_this_tenants_key_is_a_miss(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter, tenant="tenant-a") as rag:
        apples_a, _ = _chunks(rag)
        foreign = rag.store.get(rag.retriever.computer.chunk_key(apples_a.token_ids, CACHEGEN).storage_key)
    with _engine(tmp_path, llama_adapter, tenant="tenant-b") as rag:
        apples, boats = _chunks(rag)
        clean = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        # tenant a's apples cache planted under tenant b's key for boats (same length, so the
        # token count cannot tell them apart)
        _replace(rag, rag.retriever.computer.chunk_key(boats.token_ids, CACHEGEN).storage_key, foreign)
        planted = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert planted.stats.cache_misses == 1 and planted.stats.cache_hits == 1
        assert planted.text == clean.text and planted.stats.generated_tokens == clean.stats.generated_tokens


def test_an_int4_blob_under_the_cachegen_key_is_a_miss(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        apples, boats = _chunks(rag)
        clean = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        int4 = rag.store.get(rag.retriever.computer.chunk_key(apples.token_ids, INT4).storage_key)
        assert int4 is not None  # stored at index time
        _replace(rag, rag.retriever.computer.chunk_key(apples.token_ids, CACHEGEN).storage_key, int4)
        planted = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert planted.stats.cache_misses == 1 and planted.stats.cache_hits == 1
        assert planted.text == clean.text and planted.stats.generated_tokens == clean.stats.generated_tokens


def test_with_a_secret_entries_written_without_it_are_misses(tmp_path, llama_adapter, caplog):
    with _engine(tmp_path, llama_adapter) as writer:  # a writer without the secret, same tenant
        apples, boats = _chunks(writer)
        clean = writer.answer(QUESTION, chunks=[apples, boats], generation=GEN)
    with _engine(tmp_path, llama_adapter, store_secret=SECRET) as rag:
        first = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)
        assert first.stats.cache_misses == 2 and first.text == clean.text
        assert "no tag" in caplog.text
        again = rag.answer(QUESTION, chunks=[apples, boats], generation=GEN)  # its own, signed entries
        assert again.stats.cache_hits == 2 and again.text == clean.text
    with _engine(tmp_path, llama_adapter) as reader:  # a reader without the secret accepts signed entries
        assert reader.answer(QUESTION, chunks=[apples, boats], generation=GEN).stats.cache_hits == 2


def test_a_blob_for_another_token_count_is_a_miss(tmp_path, llama_adapter):
    """Chunks of different lengths: the chunk's token count, not the stored header, decides."""
    with _engine(tmp_path, llama_adapter) as rag:
        apples, _ = _chunks(rag)
        other = list(apples.token_ids[:7])
        rag.retriever.loader.load(other)  # computed and stored under its own key
        blob = rag.store.get(rag.retriever.computer.chunk_key(other, CACHEGEN).storage_key)
        key = rag.retriever.computer.chunk_key(apples.token_ids, CACHEGEN).storage_key
        _replace(rag, key, blob)
        loaded = rag.retriever.loader.load(apples.token_ids)
        assert not loaded.hit and loaded.kv.num_tokens == len(apples.token_ids)
