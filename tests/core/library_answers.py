"""The library's answers on the tiny test models, for the exactness test of the one answer driver.

``python -m tests.core.library_answers OUT.json`` (run from a checkout) records them; issue 32
recorded them from the code before the library answered through the batching scheduler
(``tests/core/library_answers.json``) and tests/core/test_answer_driver.py asserts them.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ragkv.engine import CachedText, EngineConfig, RagKV
from ragkv.generation import GenerationConfig
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 12 + "\n\nThey are red or green. " * 8, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 10 + "\n\nSails catch the wind. " * 9, "boats"),
    Document("mem:clocks", "Clocks measure time with gears and springs. " * 11, "clocks"),
]
QUESTIONS = ["Where do apples grow?", "What do sails do?", "How do clocks work?"]
CHAT = "<|im_start|>user\nName three things that float.<|im_end|>\n<|im_start|>assistant\n"
GENERATIONS = {
    "greedy": GenerationConfig(max_new_tokens=24),
    "ignore_eos": GenerationConfig(max_new_tokens=20, ignore_eos=True),
    "stop": GenerationConfig(max_new_tokens=24, stop=("e",)),
    "sampled": GenerationConfig(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3),
}
CASES = [("llama", "model"), ("qwen2", "model"), ("mistral", "model"), ("qwen3", "model"), ("llama", "int8")]


def answers(family: str, weights: str, data_dir: Path) -> dict[str, Any]:
    """Every answer of one engine over the tiny ``family`` model: ``{case: [text, generated_tokens]}``."""
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    adapter = ModelAdapter(make_model(family, len(tok)), tok, name=f"tiny-{family}")
    cfg = EngineConfig(
        data_dir=data_dir,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        store=("memory://", str(data_dir / "kv")),
        decode_weights=weights,
    )
    out: dict[str, Any] = {}
    with RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64)) as rag:
        rag.index(DOCS, progress=False)
        for name, gen in GENERATIONS.items():
            for i, q in enumerate(QUESTIONS):
                for mode in ("reuse", "full"):
                    res = rag.answer(q, mode=mode, generation=gen)
                    out[f"{name}/answer/{i}/{mode}"] = [res.text, res.stats.generated_tokens]
            parts = list(rag.generate_segments([CHAT], generation=gen))
            out[f"{name}/chat"] = ["".join(d for d, _ in parts), parts[-1][1].generated_tokens]
            segs = ["system: answer briefly.\n", CachedText(DOCS[0].text[:200]), "\nQ: where?\nA:"]
            parts = list(rag.generate_segments(segs, generation=gen))
            out[f"{name}/segments"] = ["".join(d for d, _ in parts), parts[-1][1].generated_tokens]
    return out


def all_answers() -> dict[str, Any]:
    """:func:`answers` of every case in :data:`CASES`, keyed ``family/weights``."""
    out = {}
    for family, weights in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out[f"{family}/{weights}"] = answers(family, weights, Path(tmp))
    return out


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(all_answers(), indent=1, ensure_ascii=False) + "\n")
