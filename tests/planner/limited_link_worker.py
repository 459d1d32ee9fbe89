"""Run by test_limited_link.py inside a private network namespace: a tiny model answering from a real
Redis over a tbf-limited loopback. Writes what it saw as JSON to argv[1]; argv[2] is the rate in Mbit/s."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ragkv.bench import netns
from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.model import ModelAdapter
from ragkv.planner.config import LoadConfig
from ragkv.planner.throughput import RateEstimate
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig
from tests.conftest import make_model, make_tokenizer
from tests.planner.test_adaptive_load import DOCS, LEVELS

GEN = GenerationConfig(max_new_tokens=8)


def main(out: Path, mbit: float) -> None:
    tok = make_tokenizer()
    adapter = ModelAdapter(make_model("llama", len(tok)), tok, name="tiny-llama")
    with tempfile.TemporaryDirectory() as tmp:
        redis = netns.start_redis(Path(tmp), port=6398)
        try:
            netns.set_rate(mbit)
            result = _answers(adapter, Path(tmp))
        finally:
            redis.kill()
            redis.wait()
    out.write_text(json.dumps(result))


def _answers(adapter: ModelAdapter, tmp: Path) -> dict:
    cfg = EngineConfig(
        data_dir=tmp,
        store=("redis://127.0.0.1:6398/0?timeout=60",),
        retriever=RetrieverConfig(
            top_k=3, chunker=ChunkerConfig(min_tokens=40, max_tokens=120), codec=LEVELS[0], index_codecs=LEVELS[1:]
        ),
        fusion=FusionConfig(method="naive", ratio=0.0),
        load=LoadConfig(slo_ms=1.0),  # tighter than any load can be
    )
    with RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64)) as rag:
        rag.index(DOCS, progress=False)
        chunks = list({c.text: c for c in rag.retrieve("apples boats clocks", k=8)}.values())[:3]
        question = "What do sails do?"
        tight = rag.answer(question, chunks=chunks, generation=GEN)
        full = rag.answer(question, chunks=chunks, mode="full", generation=GEN)
        rag.load_estimates.recompute = RateEstimate(1e15)  # recompute made cheap: every chunk as text
        text = rag.answer(question, chunks=chunks, generation=GEN)
    return {
        "tight": {"text": tight.text, "load": tight.stats.extra["load"], "tokens": tight.stats.generated_tokens},
        "full": {"text": full.text, "tokens": full.stats.generated_tokens},
        "all_text": {"text": text.text, "load": text.stats.extra["load"], "bytes": text.stats.bytes_loaded},
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
