"""Faults not yet tried (issue 33): two engines on one data directory, Redis flushed and restarted under
an engine, the PostgreSQL catalog under ``kill -9`` of the indexer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragkv.engine import RagKV
from ragkv.retriever.check import check, faiss_disagreement
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.types import tenant_namespace
from tests.cache.conftest import postgres_server  # noqa: F401
from tests.conftest import env_without_ragkv_settings
from tests.integrations.conftest import DOCS, GEN, make_engine
from tests.server.conftest import free_port, tiny_model_dir  # noqa: F401

EXTRA = [
    Document("mem:drums", "Drums are struck with sticks to keep the beat. " * 10, "drums"),
    Document("mem:eagles", "Eagles hunt from high above the valley floor. " * 10, "eagles"),
]


def _faiss_path(rag: RagKV) -> Path:
    path = rag.retriever.index.path
    assert path is not None
    return path


def _agree(rag: RagKV) -> None:
    """The catalog, the FAISS file as on disk and the tiers agree (nothing for ``ragkv check`` to do)."""
    assert faiss_disagreement(rag.catalog, "default", _faiss_path(rag)) == (0, 0)
    assert check(rag.retriever).problems == 0


def _sources(rag: RagKV, question: str) -> set[str]:
    return {c.source for c in rag.retrieve(question, k=8)}


def test_two_engines_on_one_data_dir_see_each_others_documents(tmp_path, llama_adapter):
    """Each engine holds the FAISS index in memory: a commit by one must not drop the other's vectors
    from the file, and a search by one must find what the other indexed."""
    with make_engine(tmp_path, llama_adapter) as a, make_engine(tmp_path, llama_adapter) as b:
        a.index(DOCS[:1], progress=False)
        b.index(DOCS[1:2], progress=False)  # b opened before a's commit: its in-memory copy lacked apples
        a.index(DOCS[2:], progress=False)  # ... and a's lacked boats
        assert "mem:clocks" in _sources(b, "Clocks measure time")  # b finds what a indexed since
        b.remove("mem:apples")  # b's save must keep clocks' vectors, which b never added itself
        _agree(a)
        a.index(EXTRA[:1], progress=False)  # a's save must not bring apples' vectors back
        _agree(b)
        for rag in (a, b):
            assert "mem:apples" not in _sources(rag, "Apples grow on trees in orchards")
            assert _sources(rag, "Boats clocks drums") == {"mem:boats", "mem:clocks", "mem:drums"}


def test_two_engines_indexing_and_removing_at_once_agree_afterwards(tmp_path, llama_adapter):
    with make_engine(tmp_path, llama_adapter) as a, make_engine(tmp_path, llama_adapter) as b:
        a.index(DOCS, progress=False)
        errors: list[BaseException] = []

        def run(step) -> None:
            try:
                step()
            except BaseException as e:  # reported below, with the thread's traceback
                errors.append(e)

        steps = [
            lambda: [b.remove(d.source) for d in DOCS[:2]],
            lambda: a.index(EXTRA, progress=False),
        ]
        threads = [threading.Thread(target=run, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for rag in (a, b):
            _agree(rag)
            found = _sources(rag, "Apples boats clocks drums eagles")
            assert found == {"mem:clocks", "mem:drums", "mem:eagles"}


class PrivateRedis:
    """A redis-server of the test's own on a free loopback port, in memory only (nothing saved), that
    the test kills and restarts (never the shared one the other Redis tests use)."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.dir = free_port(), tmp
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?timeout=0.5"

    def start(self) -> None:
        import redis

        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir)]  # fmt: skip
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def flushall(self) -> None:
        import redis

        with redis.Redis(port=self.port) as client:
            client.flushall()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server, or .ci/services.sh)")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def _redis_engine(data_dir: Path, adapter, redis_url: str) -> RagKV:
    from dataclasses import replace

    rag = make_engine(data_dir, adapter)
    rag.close()
    return RagKV(replace(rag.config, store=(redis_url,)), adapter=adapter, embedder=rag.embedder)


def test_redis_flushed_killed_and_restarted_under_an_engine_is_a_miss_never_an_error(
    tmp_path, llama_adapter, private_redis
):
    question = "Where do apples grow?"
    with _redis_engine(tmp_path, llama_adapter, private_redis.url) as rag:
        rag.index(DOCS[:2], progress=False)
        first = rag.answer(question, generation=GEN)
        assert first.stats.cache_hits > 0 and first.stats.cache_misses == 0
        private_redis.flushall()  # restarted empty, as far as the engine can tell
        flushed = rag.answer(question, generation=GEN)
        assert flushed.stats.cache_misses > 0 and flushed.text == first.text  # recomputed, and stored again
        assert rag.answer(question, generation=GEN).stats.cache_misses == 0
        private_redis.kill()
        down = rag.answer(question, generation=GEN)  # every call to the tier fails
        # the load planner heard the tier fail: the chunks are prefilled as text, no cache loaded
        assert down.stats.prefilled_chunk_tokens > 0 and down.stats.extra["load"]["tier_failed"]
        assert down.text == first.text
        private_redis.start()  # back, empty
        back = rag.answer(question, generation=GEN)
        assert back.text == first.text
        found = check(rag.retriever)
        # the catalog remembers entries the flush took: check reports them and the missing caches
        assert found.caches_missing and found.entries_dangling and not found.pending
        assert {c.split("#")[0] for c in found.caches_missing} <= {d.source for d in DOCS[:2]}
    with _redis_engine(tmp_path, llama_adapter, private_redis.url) as rag:  # `ragkv check --repair`: a new process
        fixed = check(rag.retriever, repair=True)
        assert fixed.problems == 0 and fixed.repaired > 0
        assert check(rag.retriever).problems == 0
        assert rag.answer(question, generation=GEN).stats.cache_misses == 0


# `ragkv index FILES` with the hashing embedder (the CLI's default embedder takes seconds to load)
_INDEXER = """
import sys
from pathlib import Path
from ragkv.engine import EngineConfig, RagKV
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever import kv_retriever
from ragkv.retriever.kv_retriever import RetrieverConfig
files, data, catalog, tenant, model = sys.argv[1:]
cfg = EngineConfig(data_dir=Path(data), catalog=catalog, tenant=tenant, model=model, dtype="float32", offline=True,
                   retriever=RetrieverConfig(chunker=ChunkerConfig(min_tokens=40, max_tokens=120)))
kv_retriever.batch_chunks = lambda index_size: 4  # commits of a few documents: killed after the first
with RagKV(cfg, embedder=HashingEmbedder(dim=64)) as rag:
    rag.index([files], progress=False)
"""


def _write_files(folder: Path, n: int) -> None:
    folder.mkdir()
    for i in range(n):  # a chunk each (of 40..120 tokens; a byte a token)
        text = " ".join(f"Note {i}.{j}: the orchard in valley {i} grows {j} kinds of apple." for j in range(2))
        (folder / f"note{i:02d}.txt").write_text(text)


@pytest.mark.slow  # over 10 s: a second Python process loads torch
@pytest.mark.postgres
def test_an_indexer_killed_mid_run_leaves_a_postgres_catalog_that_agrees(
    tmp_path,
    tiny_model_dir,  # noqa: F811
    llama_adapter,
    postgres_server,  # noqa: F811
):
    """``kill -9`` of an indexer (``RagKV.index``, what ``ragkv index`` runs) after its first committed
    batch: what was committed has its rows, vectors and caches; nothing half; a second run indexes the
    rest. A tenant of its own keeps the shared database's other rows out of it (and this test leaves
    the tables in place: the other PostgreSQL tests empty them before and after themselves)."""
    from ragkv.cache.catalog import Catalog
    from ragkv.engine import EngineConfig

    files, data, tenant, n = tmp_path / "notes", tmp_path / "data", f"kill-{uuid.uuid4().hex[:8]}", 16
    _write_files(files, n)
    cmd = [sys.executable, "-c", _INDEXER, str(files), str(data), postgres_server, tenant, str(tiny_model_dir)]
    env = env_without_ragkv_settings(HF_HUB_OFFLINE="1")
    indexer = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with Catalog(postgres_server) as catalog:
        deadline = time.monotonic() + 120
        while not catalog.documents(tenant) and indexer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        indexer.kill()  # SIGKILL: no cleanup of any kind
        _, err = indexer.communicate()
        assert indexer.returncode == -9, f"the indexer ended before it was killed: {err.decode()[-2000:]}"
        committed = {d.source for d in catalog.documents(tenant)}
        assert 0 < len(committed) < n
        path = data / f"chunks-{tenant_namespace(tenant)}.faiss"
        missing, _stale = faiss_disagreement(catalog, tenant, path)  # stale: killed between save and commit
        assert missing == 0  # every committed row has its vector
    cfg = EngineConfig(data_dir=data, catalog=postgres_server, tenant=tenant,
                       retriever=RetrieverConfig(chunker=ChunkerConfig(min_tokens=40, max_tokens=120)))  # fmt: skip
    # as `ragkv check`: opening the engine reconciles the FAISS file with the catalog; the model is the
    # one the indexer loaded from its folder (the same weights: the same fingerprint, so the same keys)
    with RagKV(cfg, adapter=llama_adapter, embedder=HashingEmbedder(dim=64)) as rag:
        assert check(rag.retriever).problems == 0  # each committed document has every cache
        report = rag.index([files], progress=False)  # the second run indexes the rest
        assert report.unchanged == len(committed) and report.failed == 0
        assert len(rag.catalog.documents(tenant)) == n
        assert check(rag.retriever).problems == 0
        assert faiss_disagreement(rag.catalog, tenant, path) == (0, 0)


def test_a_server_on_a_redis_store_answers_through_a_flush_and_a_restart(tmp_path, llama_adapter, private_redis):
    """The same through the HTTP app (its scheduler, the chat route): every answer is a 200."""
    from fastapi.testclient import TestClient

    from ragkv.server.app import create_app
    from ragkv.server.settings import ServerSettings

    rag = _redis_engine(tmp_path, llama_adapter, private_redis.url)
    body = {"model": "x", "messages": [{"role": "user", "content": "Where do apples grow?"}], "max_tokens": 4,
            "ragkv": {"retrieve": True}}  # fmt: skip
    with TestClient(create_app(rag, ServerSettings()), base_url="http://127.0.0.1") as client:
        for doc in DOCS[:2]:
            assert client.post("/v1/documents", json={"source": doc.source, "text": doc.text}).status_code == 201
        answers, hits = [], []
        faults = (lambda: None, private_redis.flushall, private_redis.kill, private_redis.start, lambda: None)
        for fault in faults:
            fault()
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
            hits.append((r.json()["ragkv"]["cache_hits"], r.json()["ragkv"]["cache_misses"]))
        assert len(set(answers)) == 1  # a miss recomputes the same caches
        # flushed: missed and stored again; down: prefilled as text; back empty: missed, stored, then hit
        assert hits == [(2, 0), (0, 2), (0, 0), (0, 2), (2, 0)]
