"""A LangChain client of vLLM's OpenAI server running ragkv's KV connector: ragkv retrieves, vLLM answers,
and the chunks' tokens come from ragkv's store (``usage_metadata["input_token_details"]["cache_read"]``).

    # 1. index with ragkv, with the model folder vLLM serves (the store keys hold its fingerprint)
    ragkv index --data-dir DATA --model FOLDER examples/data
    # 2. vLLM's server with the connector, in vLLM's own venv (bash tools/vllm_env.sh --no-test)
    .vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model FOLDER --port 8000 \\
        --enable-prompt-tokens-details --no-enable-prefix-caching --kv-transfer-config \\
        '{"kv_connector": "RagkvConnector", "kv_role": "kv_both", "kv_connector_module_path":
          "ragkv.integrations.vllm", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"data_dir": "DATA"}}'
    # 3. this client, in any environment with ragkv and langchain-openai
    python examples/vllm_langchain_client.py --data-dir DATA --model FOLDER

The prompt is ragkv's layout written as chat messages (ragkv's system prompt; "Documents:", each
retrieved chunk stripped and followed by a blank line, then "Question: ..."): vLLM renders them
with the model's chat template into the text ragkv's connector recognizes. Each question is asked
twice: through the connector, and opted out of it (``kv_transfer_params={"ragkv": False}``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI

from ragkv.engine import EngineConfig, RagKV
from ragkv.integrations.langchain import RagKVRetriever
from ragkv.prompt import DEFAULT_SYSTEM

QUESTIONS = ("How do honeybees tell each other where flowers are?", "Why does sourdough bread rise?")


def context(docs: list[Document]) -> str:
    """The chunks as ragkv's layout writes them: each stripped, then a blank line."""
    return "".join(d.page_content.strip() + "\n\n" for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the model folder vLLM serves (its model name)")
    parser.add_argument("--data-dir", required=True, help="ragkv's data dir (index, catalog, store)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    engine = RagKV(EngineConfig(data_dir=args.data_dir, model=args.model, device="cpu"))
    retriever = RagKVRetriever(engine, k=args.top_k)
    prompt = ChatPromptTemplate.from_messages(
        [("system", DEFAULT_SYSTEM), ("human", "Documents:\n\n{context}Question: {question}")]
    )
    settings: dict[str, Any] = {"base_url": args.url, "api_key": "none", "model": args.model}
    settings |= {"temperature": 0, "max_tokens": args.max_tokens}
    llms = {
        "vLLM + ragkv": ChatOpenAI(**settings),
        "vLLM alone": ChatOpenAI(**settings, extra_body={"kv_transfer_params": {"ragkv": False}}),
    }
    for question in QUESTIONS:
        print(f"\nQ: {question}")
        for name, llm in llms.items():
            chain = {"context": retriever | RunnableLambda(context), "question": RunnablePassthrough()} | prompt | llm
            started = time.perf_counter()
            message = chain.invoke(question)
            seconds = time.perf_counter() - started
            usage: Any = message.usage_metadata or {}
            cached = usage.get("input_token_details", {}).get("cache_read", 0)
            print(f"  {name:>13}: {seconds:5.1f} s, {cached} of {usage.get('input_tokens')} prompt tokens cached")
            print(f"  {'':>13}  {StrOutputParser().invoke(message)!r}")
    engine.close()


if __name__ == "__main__":
    main()
