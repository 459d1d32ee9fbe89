"""The openai client against ``ragkv serve``: upload a document, ask with server-side retrieval, stream,
and send your own retrieved text; the reused tokens show in ``usage.prompt_tokens_details.cached_tokens``.

    ragkv serve &                       # http://127.0.0.1:8000, the default model
    python examples/openai_client.py    # or: --url http://host:port --api-key KEY
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

DATA = Path(__file__).parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")  # only checked when the server has --api-keys
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    # 1. documents: POST /v1/documents indexes and precomputes the chunk caches (once per content)
    text = (DATA / "honeybees.txt").read_text()
    headers = {"Authorization": f"Bearer {args.api_key}"}
    r = httpx.post(f"{args.url}/v1/documents", json={"source": "example:honeybees", "text": text},
                   headers=headers, timeout=600)  # fmt: skip
    r.raise_for_status()
    print(f"indexed example:honeybees: {r.json()['chunks']} chunks, {r.json()['computed']} caches computed")

    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    question = "How do honeybees tell each other where flowers are?"

    # 2. server-side retrieval: the server retrieves, reuses the chunk caches, returns the sources
    answer: Any = client.chat.completions.create(  # Any: the ragkv fields are extras to the openai types
        model="ragkv", messages=[{"role": "user", "content": question}], max_tokens=args.max_tokens,
        extra_body={"ragkv": {"retrieve": True, "top_k": 2}},
    )  # fmt: skip
    stats = answer.model_extra["ragkv"]
    print(f"\nQ: {question}\nA: {answer.choices[0].message.content}")
    print(f"   sources: {', '.join(s['source'] + '#' + str(s['chunk']) for s in stats['sources'])}")
    print(f"   cached_tokens {answer.usage.prompt_tokens_details.cached_tokens} of {answer.usage.prompt_tokens}, "
          f"TTFT {stats['ttft_ms']:.0f} ms")  # fmt: skip

    # 3. streaming, with your own retrieved text in the prompt (what LangChain / LlamaIndex apps send):
    #    text the server has indexed is found verbatim and its cache reused
    context = "\n\n".join(s["text"] for s in stats["sources"])
    messages: Any = [{"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]
    print("\nstreamed: ", end="", flush=True)
    usage: Any = None
    for chunk in client.chat.completions.create(
        model="ragkv", messages=messages, max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    if usage is not None:
        print(f"\n   cached_tokens {usage.prompt_tokens_details.cached_tokens} of {usage.prompt_tokens}")


if __name__ == "__main__":
    main()
