"""Indexing many small files: time against their number, batched commits vs one commit per document.

Each commit re-writes and fsyncs the whole FAISS file, so one commit per document costs time
quadratic in the number of files; ``KVRetriever`` commits in batches that grow with the index
(``ragkv.retriever.kv_retriever.batch_chunks``). This prints, for each N, the seconds to index N
one-chunk files into a fresh data dir, both ways, and the seconds per 1,000 files between sizes (the
slope: flat when linear). A tiny random-weight model and a hashing embedder keep the model's share
small, so the commit cost shows.

    .venv/bin/python experiments/index_many.py --sizes 1000 2000 4000
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch

import ragkv.retriever.kv_retriever as kv_retriever
from ragkv.engine import EngineConfig, RagKV
from ragkv.model import ModelAdapter
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.retriever.transforms import TransformConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_tests = importlib.import_module("tests.conftest")  # the tests' tiny model builders (no download)
make_model, make_tokenizer = _tests.make_model, _tests.make_tokenizer


def _run(adapter: ModelAdapter, n: int, per_document: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to index ``n`` one-chunk files into a fresh data dir."""
    docs = [Document(f"mem:file{i}", f"File {i} says hello to number {i * 7 % 1000}.", f"f{i}") for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(
            data_dir=Path(tmp),
            store=(str(Path(tmp) / "kv"),),
            retriever=RetrieverConfig(
                chunker=ChunkerConfig(min_tokens=8, max_tokens=64), transform=TransformConfig(levels=())
            ),
        )
        batch = kv_retriever.batch_chunks
        if per_document:
            kv_retriever.batch_chunks = lambda index_size: 1  # the old behaviour: one commit per document
        try:
            with RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64)) as rag:
                started, cpu = time.perf_counter(), time.process_time()
                report = rag.index(docs, progress=False)
                seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        finally:
            kv_retriever.batch_chunks = batch
        assert report.chunks == n and report.failed == 0
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--baseline-up-to", type=int, default=4000, help="largest N run one commit per document")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    adapter = ModelAdapter(make_model("llama", len(tok)), tok, name="tiny-llama")
    print("| files | batched: wall s (CPU s) | s per 1k files | one commit per document: wall s (CPU s) | s/1k files |")
    print("| --- | --- | --- | --- | --- |")
    last: dict[bool, tuple[int, float]] = {}
    for n in args.sizes:
        cells = [str(n)]
        for per_document in (False, True):
            if per_document and n > args.baseline_up_to:
                cells += ["-", "-"]
                continue
            seconds, cpu = _run(adapter, n, per_document)
            prev = last.get(per_document)
            slope = (seconds - prev[1]) / (n - prev[0]) * 1000 if prev else seconds / n * 1000
            last[per_document] = (n, seconds)
            cells += [f"{seconds:.1f} ({cpu:.1f})", f"{slope:.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
