"""Two processes sharing one store: one indexes documents, another answers from their caches.

    pip install 'ragkv[langchain]'
    python examples/shared_store.py index  --data-dir /tmp/ragkv-shared examples/data
    python examples/shared_store.py answer --data-dir /tmp/ragkv-shared "How do bees find flowers?"

The indexing process chunks the documents and writes every chunk's KV cache to the store under
``--data-dir`` (a disk tier, next to the SQLite catalog and the FAISS index); it can run on
another machine or hours earlier. The answering process is a new Python process with nothing in
memory: its LangChain chain retrieves, finds the chunks in the prompt and loads their caches from
disk, so its very first answer prefills only the question. Both times to first token, without and
with ragkv, are printed. Point several answering processes (or a shared ``store`` URL such as
redis:// or s3://) at the same store to share the work of indexing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ragkv.engine import EngineConfig, RagKV

DEFAULT_DIR = Path(tempfile.gettempdir()) / "ragkv-shared-store"


def index(data_dir: Path, docs: list[Path]) -> None:
    with RagKV(EngineConfig(data_dir=data_dir)) as rag:
        report = rag.index(docs, progress=False)
    print(
        f"indexed {report.documents} documents ({report.unchanged} unchanged): {report.chunks} chunks, "
        f"{report.computed} caches computed, {report.bytes_stored} bytes stored under {data_dir}"
    )


def answer(data_dir: Path, questions: list[str], k: int, max_new_tokens: int) -> None:
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from ragkv.integrations.langchain import ChatRagKV, RagKVRetriever

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question using only the documents. Be brief."),
            ("human", "Documents:\n\n{context}\n\nQuestion: {question}"),
        ]
    )
    with RagKV(EngineConfig(data_dir=data_dir)) as rag:
        retriever = RagKVRetriever(engine=rag, k=k)
        context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))

        def chain(reuse: bool):
            model = ChatRagKV(engine=rag, max_tokens=max_new_tokens, reuse_chunks=reuse)
            return {"context": context, "question": RunnablePassthrough()} | prompt | model

        with_ragkv, plain = chain(True), chain(False)
        # first model call pays one-time setup; a prompt with no chunks keeps the store untouched
        ChatRagKV(engine=rag, max_tokens=1).invoke("warm-up")
        for question in questions:
            # ragkv first: its caches come from the indexing process's store, not from a warm-up here
            reply = with_ragkv.invoke(question)
            s = reply.response_metadata["ragkv"]
            base = plain.invoke(question).response_metadata["ragkv"]
            print(f"Q: {question}")
            print(f"A: {reply.content.strip()}")
            print(
                f"   TTFT without ragkv: {base['ttft_ms']:8.1f} ms  (prompt {base['prompt_tokens']} tokens prefilled)"
            )
            print(
                f"   TTFT with ragkv:    {s['ttft_ms']:8.1f} ms  (chunks {s['chunks_in_prompt']}, cache hits "
                f"{s['cache_hits']}, {s['bytes_loaded']} bytes loaded, prefilled chunk tokens "
                f"{s['prefilled_chunk_tokens']})"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("index", help="index documents into the shared store")
    pi.add_argument("docs", type=Path, nargs="+", help="files or folders")
    pa = sub.add_parser("answer", help="answer questions from the shared store")
    pa.add_argument("questions", nargs="+")
    pa.add_argument("--k", type=int, default=3, help="chunks per question")
    pa.add_argument("--max-new-tokens", type=int, default=48)
    for sp in (pi, pa):
        sp.add_argument("--data-dir", type=Path, default=DEFAULT_DIR, help=f"shared ragkv data dir ({DEFAULT_DIR})")
    args = p.parse_args(argv)
    if args.command == "index":
        index(args.data_dir, args.docs)
    else:
        answer(args.data_dir, args.questions, args.k, args.max_new_tokens)


if __name__ == "__main__":
    main()
