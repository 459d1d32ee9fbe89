"""LlamaIndex answers with reuse vs full prefill of the same prompt, per fusion ratio (deterministic).

    python experiments/frameworks_answers.py [--modes tree_summarize,compact] [--ratios 0.15,0.3,0.5,1.0]
                                       [--questions 3] [--max-tokens 16] [--json rows.json]

The corpus and query engine of ``experiments/frameworks.py``. Per question and response mode, the prompt
the synthesizer sends (its last LLM call) is captured, cut into segments as ``RagKVLLM`` cuts it,
and prefilled twice: whole, from scratch (``RagKV.prefill([prompt], mode="full")``, the plain
model), and fused from the stored chunk caches at each ratio. Reported: KL(full || fused) of the
first answer token, whether the top token agrees, and whether the greedy answer is full prefill's.
No timing: greedy decoding makes every number here reproducible on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import frameworks as fw  # experiments/frameworks.py: the same corpus and question

from ragkv.bench.table import Column, format_table

QUESTIONS = (
    fw.QUESTION,
    "What does heapq.heappop return?",
    "How do I insert an item into a sorted list with bisect?",
    "What does functools.lru_cache do?",
    "How do I remove common leading whitespace from text with textwrap?",
    "How do I get the smallest item from a heap without popping it?",
)


def first_token_kl(full: Any, fused: Any) -> float:
    """KL(full || fused) of two ``[vocab]`` logit vectors."""
    import torch

    p, q = torch.log_softmax(full.float(), -1), torch.log_softmax(fused.float(), -1)
    return float((p.exp() * (p - q)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="tree_summarize,compact")
    ap.add_argument("--ratios", default="0.15,0.3,0.5,1.0")
    ap.add_argument("--questions", type=int, default=3, help=f"the first N of {len(QUESTIONS)} built-in questions")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="write the rows (with the answers) to this file")
    args = ap.parse_args()
    logging.getLogger("ragkv").setLevel(logging.ERROR)

    from llama_index.core import VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter

    import ragkv.integrations.llamaindex as li
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.fusion import FusionConfig
    from ragkv.generation import GenerationConfig, decode_loop
    from ragkv.integrations import _bridge
    from ragkv.model import load_model
    from ragkv.retriever.embedder import HashingEmbedder

    prompts: list[str] = []
    stream = _bridge.stream

    def capture(engine: Any, prompt: str, gen: Any, *, reuse_chunks: bool = True) -> Any:
        prompts.append(prompt)
        return stream(engine, prompt, gen, reuse_chunks=reuse_chunks)

    li._bridge.stream = capture  # type: ignore[assignment]  # the prompts RagKVLLM generates from
    adapter = load_model()
    gen = GenerationConfig(max_new_tokens=args.max_tokens)

    def answer(p: Any) -> str:
        return str(adapter.tokenizer.decode(list(decode_loop(adapter, p.cache, p.logits, p.num_tokens, gen))))

    ratios = [float(r) for r in args.ratios.split(",")]
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        RagKV(
            EngineConfig(data_dir=Path(tmp), store=("memory://",)), adapter=adapter, embedder=HashingEmbedder(dim=256)
        ) as rag,
    ):
        index = VectorStoreIndex.from_documents(
            fw.documents(),
            embed_model=li.RagKVEmbedding(rag),
            transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)],
        )
        pp = [li.RagKVNodePostprocessor(rag, progress=False)]
        for question in QUESTIONS[: args.questions]:
            for mode in args.modes.split(","):
                llm = li.RagKVLLM(rag, max_tokens=1)
                index.as_query_engine(llm=llm, node_postprocessors=pp, similarity_top_k=3, response_mode=mode).query(
                    question
                )
                prompt = prompts[-1]
                segments = _bridge.registry(rag).split(prompt)
                full = rag.prefill([prompt], mode="full")
                full_answer = answer(full)
                for ratio in ratios:
                    fused = rag.prefill(segments, fusion=FusionConfig(ratio=ratio))
                    text = answer(fused)
                    rows.append(
                        {
                            "question": question[:40],
                            "mode": mode,
                            "prompt_tokens": full.num_tokens,
                            "ratio": ratio,
                            "kl": first_token_kl(full.logits, fused.logits),
                            "top1": "yes" if int(full.logits.argmax()) == int(fused.logits.argmax()) else "no",
                            "same_answer": "yes" if text == full_answer else "no",
                            "full_answer": full_answer,
                            "answer": text,
                        }
                    )
                print(f"{mode}: {question}", flush=True)
    columns = (
        "question",
        "mode",
        "prompt_tokens",
        "ratio",
        Column("kl", "first-token KL", "{:.4f}"),
        "top1",
        "same_answer",
    )
    print(format_table(rows, columns))
    for ratio in ratios:
        same = [r for r in rows if r["ratio"] == ratio]
        print(f"ratio {ratio}: {sum(r['same_answer'] == 'yes' for r in same)}/{len(same)} answers equal full prefill's")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
