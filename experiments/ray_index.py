"""Indexing throughput: one process vs Ray with 1 and 2 actors, and what bounds it past one machine.

    RAGKV_BENCH_REDIS=redis://127.0.0.1:6379/14 \
    RAGKV_BENCH_CATALOG=postgresql+psycopg://ragkv:ragkv@127.0.0.1:5432/ragkv_test_w4 \
    python experiments/ray_index.py [--docs 6] [--chars 6000]

Same corpus (stdlib pydoc text), same run, default model, a Redis store and a PostgreSQL catalog;
each executor indexes into a tenant of its own, so every chunk is prefilled. A local Ray with 2
CPUs is started before timing (a cluster is running before a job), so the Ray rows include the
actors' model load but not Ray's start. The embedder is the hashing one (no model) so the rows
compare prefill work. Then the two shared services a cluster of N workers writes to are measured:
the store's write bandwidth (one client, chunk-sized blobs) and the catalog's commit rate (cache
entries recorded, documents committed with their chunk rows).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from ragkv.digests import text_digest
from ragkv.engine import EngineConfig, RagKV
from ragkv.retriever.corpus import stdlib_corpus
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import IndexPlan, IndexReport
from ragkv.retriever.ray_index import RayConfig

REDIS = os.environ.get("RAGKV_BENCH_REDIS", "redis://127.0.0.1:6379/15")
CATALOG = os.environ.get("RAGKV_BENCH_CATALOG", "postgresql+psycopg://ragkv:ragkv@127.0.0.1:5432/ragkv_test")


def engine(root: Path, tenant: str, prefix: str) -> RagKV:
    config = EngineConfig(data_dir=root / tenant, store=(f"{REDIS}?prefix={prefix}",), catalog=CATALOG, tenant=tenant)
    return RagKV(config, embedder=HashingEmbedder(dim=384))


def row(name: str, r: IndexReport) -> str:
    return f"| {name} | {r.computed} | {r.seconds:.1f} | {r.computed / r.seconds:.2f} | {r.bytes_stored / 1e6:.1f} |"


def store_bandwidth(rag: RagKV) -> str:
    """Re-write every stored blob (same keys): MB/s one client sustains into the store."""
    keys = [e.storage_key for e in rag.catalog.entries(rag.config.tenant)]
    blobs = {k: rag.store.get(k) for k in keys}
    t0 = time.perf_counter()
    for k, v in blobs.items():
        assert v is not None and rag.store.put(k, v)
    dt = time.perf_counter() - t0
    size = sum(len(v or b"") for v in blobs.values())
    return (
        f"store writes: {len(blobs)} blobs, {size / 1e6:.1f} MB in {dt:.2f} s = {size / 1e6 / dt:.1f} MB/s, "
        f"{len(blobs) / dt:.0f} puts/s"
    )


def catalog_rate(rag: RagKV, docs: list[Document]) -> str:
    """Re-record every entry and re-commit every document: rows/s the catalog takes from one driver."""
    r = rag.retriever
    entries = r.catalog.entries(rag.config.tenant)
    t0 = time.perf_counter()
    for e in entries:
        r.catalog.record_entry(
            e.storage_key,
            tenant=e.tenant,
            tokens_digest=e.tokens_digest,
            codec=e.codec,
            level=e.level,
            nbytes=e.nbytes,
            num_tokens=e.num_tokens,
        )
    t_entries = time.perf_counter() - t0
    digests = [(d, text_digest(d.text)) for d in docs]
    chunked = [(d, digest, r._chunk(d, digest)) for d, digest in digests]  # what a run commits
    t0 = time.perf_counter()
    for doc, digest, chunks in chunked:  # one commit per document, as each one's caches land
        plan = IndexPlan(IndexReport(), [], [], ready=[(doc, digest, chunks)])
        r._commit(plan)
    t_docs = time.perf_counter() - t0
    n_chunks = sum(len(c) for _, _, c in chunked)
    return (
        f"catalog: {len(entries)} entries recorded in {t_entries:.2f} s = {len(entries) / t_entries:.0f} entries/s; "
        f"{len(chunked)} documents ({n_chunks} chunk rows, with FAISS adds and saves) committed in {t_docs:.2f} s "
        f"= {n_chunks / t_docs:.0f} chunk rows/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--chars", type=int, default=6000)
    args = parser.parse_args()
    docs = stdlib_corpus(max_chars_per_module=args.chars)[: args.docs]
    run_id = uuid.uuid4().hex[:8]
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    lines = ["| executor | chunks prefilled | seconds | chunks/s | MB stored |", "| --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs: list[tuple[str, dict[str, Any]]] = [
            ("one process (2 threads)", {}),
            ("Ray, 1 actor (2 CPUs)", {"executor": "ray", "ray": RayConfig(actors=1, cpus_per_actor=2)}),
            ("Ray, 2 actors (1 CPU each)", {"executor": "ray", "ray": RayConfig(actors=2, cpus_per_actor=1)}),
        ]
        last = None
        for i, (name, kw) in enumerate(runs):
            rag = engine(root, f"bench-{run_id}-{i}", f"bench-{run_id}:")
            report = rag.index(docs, progress=False, **kw)
            lines.append(row(name, report))
            print(lines[-1], flush=True)
            last = rag
        assert last is not None
        print("\n".join(lines))
        print(store_bandwidth(last))
        print(catalog_rate(last, docs))
    ray.shutdown()
    import redis

    client = redis.Redis.from_url(REDIS)
    for name in client.scan_iter(match=f"bench-{run_id}:*"):
        client.delete(name)


if __name__ == "__main__":
    main()
