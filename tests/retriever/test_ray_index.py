"""Indexing on Ray: the same catalog rows, FAISS file and cache bytes as one process; faults don't lose chunks.

A real local Ray (``ray.init(num_cpus=2)``, one session for the module), a real Redis store and
the PostgreSQL catalog; a tiny random-weight Llama saved to disk is what every actor loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ragkv.cache.catalog import Catalog
from ragkv.engine import EngineConfig, RagKV
from ragkv.retriever import ray_index
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import IndexReport, RetrieverConfig
from ragkv.retriever.precompute import ChunkResult
from ragkv.retriever.ray_index import ChunkWorker, RayConfig, WorkerSpec, check_store_reach, ray_compute
from ragkv.types import DEFAULT_CODEC, CodecSpec, tenant_namespace
from tests.conftest import env_without_ragkv_settings, make_model, make_tokenizer

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.redis, pytest.mark.postgres]

TENANT = "default"
SHARED = "\n\nEvery document ends with this same closing line."
DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 6 + "\n\nThey are red or green. " * 5 + SHARED, "t"),
    Document(
        "mem:boats", "Boats float on water and carry people. " * 5 + "\n\nSails catch the wind. " * 5 + SHARED, "t"
    ),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 6 + "\n\n" + SHARED, "t"),
    Document("mem:doors", "Doors open and close on hinges. " * 7, "t"),
]
RETRIEVER = RetrieverConfig(
    top_k=2,
    chunker=ChunkerConfig(min_tokens=30, max_tokens=80),
    codec=DEFAULT_CODEC,  # what a generator started with the defaults loads
    index_codecs=(CodecSpec("raw", 0),),
)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray for the module (starting one costs seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def second_redis(redis_server: str) -> Iterator[str]:
    """A Redis tier URL with a key prefix of its own, apart from ``redis_url``'s."""
    import redis

    prefix = f"ragkv-test-{uuid.uuid4().hex[:12]}:"
    yield f"{redis_server}?prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    for name in client.scan_iter(match=f"{prefix}*"):
        client.delete(name)
    client.close()


def engine(data_dir: Path, model_dir: Path, store: str, catalog: str) -> RagKV:
    config = EngineConfig(
        data_dir=data_dir, model=str(model_dir), store=(store,), catalog=catalog, tenant=TENANT, retriever=RETRIEVER
    )
    return RagKV(config, embedder=HashingEmbedder(dim=64))


def on_ray(rag: RagKV, actors: int = 2, **kw: Any) -> IndexReport:
    return rag.index(DOCS, progress=False, executor="ray", ray=RayConfig(actors=actors, **kw))


def catalog_rows(url: str) -> tuple[list[Any], list[Any], list[Any]]:
    """Documents, chunk rows and cache entries, without timestamps."""
    with Catalog(url) as cat:
        docs = cat.documents(TENANT)
        rows = cat.all_chunk_rows(TENANT)
        chunks = list(zip(rows, cat.chunks_by_rows(rows, TENANT), strict=True))
        entries = [
            (e.storage_key, e.tokens_digest, e.codec, e.level, e.nbytes, e.num_tokens) for e in cat.entries(TENANT)
        ]
    return docs, chunks, entries


def stored(rag: RagKV) -> dict[str, bytes]:
    """Every cache entry the catalog records, read back from the store."""
    keys = [e.storage_key for e in rag.catalog.entries(TENANT)]
    found = {k: rag.store.get(k) for k in keys}
    assert all(v is not None for v in found.values())
    return {k: v for k, v in found.items() if v is not None}


def test_ray_gives_what_one_process_gives(ray_session, model_dir, tmp_path, redis_url, second_redis, postgres_url):
    single_catalog = f"sqlite:///{tmp_path / 'single.db'}"
    with engine(tmp_path / "single", model_dir, redis_url, single_catalog) as one:
        local = one.index(DOCS, progress=False)
        local_bytes = stored(one)
    with engine(tmp_path / "ray", model_dir, second_redis, postgres_url) as rag:
        report = on_ray(rag)
        ray_bytes = stored(rag)
    assert local.failed == report.failed == 0 and local.errors == report.errors == []
    same = ("documents", "unchanged", "chunks", "computed", "reused", "bytes_stored")
    assert [getattr(report, f) for f in same] == [getattr(local, f) for f in same]
    assert local.reused >= 2  # the shared closing chunk was computed once
    assert catalog_rows(postgres_url) == catalog_rows(single_catalog)
    faiss_file = f"chunks-{tenant_namespace(TENANT)}.faiss"
    assert (tmp_path / "ray" / faiss_file).read_bytes() == (tmp_path / "single" / faiss_file).read_bytes()
    assert ray_bytes == local_bytes and len(ray_bytes) == 2 * local.computed  # two codecs per chunk

    with engine(tmp_path / "ray", model_dir, second_redis, postgres_url) as rag:
        again = on_ray(rag)
    assert (again.unchanged, again.computed, again.chunks) == (len(DOCS), 0, 0)


def test_stored_chunks_are_skipped_before_ray_is_asked(model_dir, tmp_path, redis_url, postgres_url):
    with engine(tmp_path / "a", model_dir, redis_url, postgres_url) as rag:
        rag.index(DOCS, progress=False)
        rag.catalog.remove_document("mem:apples", TENANT)
        plan = rag.retriever.plan_index(DOCS)
        asked: list[Sequence[tuple[int, ...]]] = []

        def compute(work: Sequence[tuple[int, ...]]) -> Iterator[tuple[int, ChunkResult]]:
            asked.append(work)
            return iter(())

        report = rag.retriever.index_documents(DOCS, progress=False, compute=compute)
    assert [d.source for d, _, _ in plan.documents] == ["mem:apples"] and plan.work == []
    assert asked == [[]] and report.chunks > 0 and report.computed == 0


def test_an_actor_killed_midway_loses_no_chunk(ray_session, model_dir, tmp_path, redis_url, postgres_url, monkeypatch):
    started: list[Any] = []
    real_start = ray_index._start_actors

    def start(*args: Any) -> list[Any]:
        started.extend(real_start(*args))
        return started

    monkeypatch.setattr(ray_index, "_start_actors", start)
    with engine(tmp_path / "a", model_dir, redis_url, postgres_url) as rag:
        spec = WorkerSpec.for_retriever(rag.retriever, str(model_dir), rag.config.store_urls())
        inner = ray_compute(spec, RayConfig(actors=2))
        killed = []

        def compute(work: Sequence[tuple[int, ...]]) -> Iterator[tuple[int, ChunkResult]]:
            for n, item in enumerate(inner(work)):
                if n == 0:  # a real kill of a live actor process with chunks queued on it
                    ray.kill(started[0], no_restart=False)
                    killed.append(item[0])
                yield item

        keys = {
            rag.retriever.computer.chunk_key(token_ids, codec).storage_key
            for token_ids in rag.retriever.plan_index(DOCS).work
            for codec in RETRIEVER.stored_codecs
        }
        report = rag.retriever.index_documents(DOCS, progress=False, compute=compute)
        assert killed and report.failed == 0 and report.errors == [] and report.failed_documents == []
        assert report.chunks > 0 and len(rag.catalog.documents(TENANT)) == len(DOCS)
        assert all(rag.store.contains(k) for k in keys)
        assert sorted(rag.store.keys(tenant_namespace(TENANT))) == sorted(keys)  # each chunk once, nothing else


class PoisonedWorker(ChunkWorker):
    """Raises on every attempt at a chunk containing POISON: Ray retries it, then it is reported."""

    def compute(self, token_ids: tuple[int, ...]) -> ChunkResult:
        if "POISON" in self.computer.adapter.tokenizer.decode(list(token_ids)):
            raise RuntimeError("poisoned chunk")
        return super().compute(token_ids)


def test_a_chunk_that_always_fails_is_reported_the_rest_lands_and_a_generator_answers_from_it(
    ray_session, model_dir, tmp_path, redis_url, postgres_url, monkeypatch
):
    """One Ray run (one actor) for both: a poisoned chunk, and a generator elsewhere reading the rest."""
    monkeypatch.setattr(ray_index, "ChunkWorker", PoisonedWorker)
    docs = [*DOCS, Document("mem:poison", "This document is POISON and nothing else. " * 3, "t")]
    with engine(tmp_path / "indexer", model_dir, redis_url, postgres_url) as rag:
        report = rag.index(docs, progress=False, executor="ray", ray=RayConfig(actors=1, max_task_retries=1))
        assert report.failed_documents == ["mem:poison"] and report.failed == 1
        assert len(report.errors) == 1 and report.errors[0].startswith("mem:poison#0: RuntimeError: poisoned chunk")
        assert sorted(d.source for d in rag.catalog.documents(TENANT)) == sorted(d.source for d in DOCS)
    args = ["--model", str(model_dir), "--store", redis_url, "--catalog", postgres_url]
    answer = subprocess.run(
        [sys.executable, "-m", "ragkv.cli", "ask", "--json", "--max-new-tokens", "4", "--top-k", "2"]
        + ["--data-dir", str(tmp_path / "generator"), *args, "How do boats move?"],
        capture_output=True,
        text=True,
        env=env_without_ragkv_settings(),
        timeout=600,
    )
    assert answer.returncode == 0, answer.stderr
    stats = json.loads(answer.stdout.strip().splitlines()[-1])["stats"]
    assert stats["prefilled_chunk_tokens"] == 0 and stats["cache_hits"] >= 1 and stats["cache_misses"] == 0


def test_ray_refuses_a_store_the_workers_cannot_share():
    check_store_reach(["/data/kv"], nodes=1)  # one machine: its disk is shared by its actors
    check_store_reach(["memory://", "redis://10.0.0.5:6379/0"], nodes=8)
    with pytest.raises(ValueError, match="outside one process"):
        check_store_reach(["memory://"], nodes=1)
    with pytest.raises(ValueError, match=r"3 nodes.*redis://"):
        check_store_reach(["memory://", "disk:///data/kv"], nodes=3)


def test_cli_ray_with_a_memory_only_store_is_a_one_line_error(model_dir, tmp_path, monkeypatch, capsys):
    from tests.core.test_cli import run

    (tmp_path / "doc.txt").write_text("Apples grow on trees in orchards. " * 10)
    args = ["index", str(tmp_path / "doc.txt"), "--data-dir", str(tmp_path / "d"), "--model", str(model_dir)]
    code, _, err = run(monkeypatch, capsys, *args, "--store", "memory://", "--ray")
    last = err.strip().splitlines()[-1]  # after the model's loading bar
    assert code == 2 and last.startswith("error: ") and "redis://" in last and "Traceback" not in err
    with Catalog(f"sqlite:///{tmp_path / 'd' / 'catalog.db'}") as cat:
        assert cat.documents(TENANT) == []
