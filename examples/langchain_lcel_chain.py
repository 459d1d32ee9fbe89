"""A LangChain LCEL RAG chain over ragkv's index: retriever | prompt | chat model, reusing chunk caches.

    pip install 'ragkv[langchain]'
    python examples/langchain_lcel_chain.py                    # examples/data, built-in questions
    python examples/langchain_lcel_chain.py --docs my_notes/ --question "What is ...?"

Runs offline with ragkv's defaults. ``rag.index`` chunks the documents and precomputes every
chunk's KV cache; the chain retrieves with ``RagKVRetriever``, joins the documents into a chat
prompt and generates with ``ChatRagKV``, which finds the chunks in the prompt and loads their
caches, so even the first question prefills only the question. Each question is answered twice,
by the plain model and with ragkv, and both times to first token are printed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from ragkv.engine import EngineConfig, RagKV
from ragkv.integrations.langchain import ChatRagKV, RagKVRetriever

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = [
    "How long does a sourdough starter take to peak after feeding?",
    "How do honeybees tell each other where flowers are?",
]
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the documents. Be brief."),
        ("human", "Documents:\n\n{context}\n\nQuestion: {question}"),
    ]
)


def join_documents(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


def build_chain(rag: RagKV, model: ChatRagKV, k: int):
    retriever = RagKVRetriever(engine=rag, k=k)
    return {"context": retriever | join_documents, "question": RunnablePassthrough()} | PROMPT | model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=Path, default=DATA, help="folder of documents (default: examples/data)")
    p.add_argument("--data-dir", type=Path, default=None, help="ragkv data dir (default: a temporary one)")
    p.add_argument("--question", action="append", help="question to ask (repeatable)")
    p.add_argument("--k", type=int, default=3, help="chunks per question")
    p.add_argument("--max-new-tokens", type=int, default=48)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="ragkv-langchain-"))
    rag = RagKV(EngineConfig(data_dir=data_dir))
    report = rag.index([args.docs], progress=False)
    print(f"indexed {report.documents} documents, {report.chunks} chunks ({report.computed} caches computed)")

    with_ragkv = build_chain(rag, ChatRagKV(engine=rag, max_tokens=args.max_new_tokens), args.k)
    plain = build_chain(rag, ChatRagKV(engine=rag, max_tokens=args.max_new_tokens, reuse_chunks=False), args.k)

    plain.invoke("warm-up")  # first model call pays one-time setup; keep it out of the timings
    for question in args.question or QUESTIONS:
        base = plain.invoke(question).response_metadata["ragkv"]
        answer = with_ragkv.invoke(question)
        s = answer.response_metadata["ragkv"]
        print(f"Q: {question}")
        print(f"A: {answer.content.strip()}")
        print(f"   TTFT without ragkv: {base['ttft_ms']:8.1f} ms  (prompt {base['prompt_tokens']} tokens prefilled)")
        print(
            f"   TTFT with ragkv:    {s['ttft_ms']:8.1f} ms  (chunks {s['chunks_in_prompt']}, "
            f"cache hits {s['cache_hits']}, reused {s['reused_tokens']}, recomputed {s['recomputed_tokens']}, "
            f"prefilled chunk tokens {s['prefilled_chunk_tokens']})"
        )
    rag.close()


if __name__ == "__main__":
    main()
