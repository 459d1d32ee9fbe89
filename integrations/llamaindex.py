"""LlamaIndex integration: a local LLM that reuses ragkv chunk caches, a node postprocessor, a retriever.

``ragkv.integrations.llamaindex.RagKVLLM`` and ``RagKVRetriever`` are LlamaIndex classes; the
LangChain ones of the same names live in ``ragkv.integrations.langchain``.

Install with ``pip install 'ragkv[llamaindex]'``. Typical use::

    rag = RagKV()
    llm = RagKVLLM(rag)
    engine = index.as_query_engine(llm=llm, node_postprocessors=[RagKVNodePostprocessor(rag)])
    response = engine.query("...")
    response.metadata["ragkv"]  # ttft_ms, reused / recomputed / prefilled chunk tokens, cache hits

The postprocessor registers the exact text each retrieved node contributes to the prompt (its
content in ``MetadataMode.LLM``) and makes sure its cache is stored; the LLM finds those texts in
whatever prompt the synthesizer or chat engine built, loads their caches and prefills only the
rest. ``RagKVRetriever`` retrieves from ragkv's own index and registers what it returns, so it can
replace the postprocessor. Stats: ``CompletionResponse.additional_kwargs["ragkv"]`` and
``ChatResponse.additional_kwargs["ragkv"]`` per LLM call; ``Response.metadata["ragkv"]`` and
``AgentChatResponse.metadata["ragkv"]`` summed over a query's calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ragkv.integrations._lazy import missing_framework

try:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise missing_framework("llamaindex", "llamaindex", "llama-index-core") from e

from pydantic import Field

from ragkv.engine import RagKV
from ragkv.generation import GenerationConfig
from ragkv.integrations import _bridge
from ragkv.integrations._llamaindex_stats import current_sinks, install, record, record_build

__all__ = ["RagKVEmbedding", "RagKVLLM", "RagKVNodePostprocessor", "RagKVRetriever"]

_ROLES = {
    MessageRole.DEVELOPER: "system",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.FUNCTION: "tool",
}
_GEN_KEYS = frozenset(GenerationConfig.__dataclass_fields__)
# LlamaIndex's own names for generation settings (what other LlamaIndex LLMs take)
_ALIASES = {"max_tokens": "max_new_tokens", "num_output": "max_new_tokens"}
_CALL_KEYS = _GEN_KEYS | frozenset(_ALIASES)
logger = logging.getLogger(__name__)
_warned_kwargs: set[str] = set()


def _aliased(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with LlamaIndex names (``max_tokens``) renamed to ragkv's; both given must agree."""
    out = dict(kwargs)
    for alias, name in _ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if value is None:
                continue
            if out.get(name) is not None and out[name] != value:
                raise ValueError(f"{alias}={value} and {name}={out[name]} disagree; pass one of them")
            out[name] = value
    return out


def _message_dict(m: ChatMessage) -> dict[str, str]:
    return {"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""}


class RagKVLLM(CustomLLM):
    """A ragkv engine's local model as a LlamaIndex LLM, reusing the caches of registered chunks.

    Chat calls render the messages with the tokenizer's chat template; ``complete`` wraps the
    prompt as one user turn unless ``formatted=True`` or ``chat_template=False`` (raw completion).
    Keyword arguments named like ``GenerationConfig`` fields, or LlamaIndex's ``max_tokens``,
    override the settings per call; other per-call keywords are ignored with a logged warning.

    Without ``RagKVNodePostprocessor`` the LLM still finds the chunks of the engine's own index
    (``RagKV.index``) in its prompts; a prompt that looks like retrieved context but reuses no
    cache gets ``reuse_warning`` in its stats and a one-time logged warning saying why.

    Args:
        engine: the ragkv engine (default: a process-wide ``RagKV()`` with every default).
        max_new_tokens: answer length cap; ``max_tokens`` (LlamaIndex's name) is the same setting.
        context_window: what ``metadata`` reports to LlamaIndex's prompt packing (default and
            ceiling: the model's context length).

    Raises:
        TypeError: a keyword that is not a setting of this LLM (say, an API key or a timeout).
    """

    engine: Any = Field(default=None, exclude=True, description="the ragkv.engine.RagKV that generates")
    max_new_tokens: int = Field(default=256, gt=0, description="answer length cap (LlamaIndex's num_output)")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = no top-k filter")
    seed: int | None = Field(default=None, description="sampling seed")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    chat_template: bool = Field(default=True, description="wrap completion prompts in the chat template")
    reuse_chunks: bool = Field(default=True, description="False: prefill every prompt whole (a baseline)")
    context_window: int | None = Field(default=None, gt=0, description="None: the model's context length")

    def __init__(self, engine: RagKV | None = None, **kwargs: Any) -> None:
        kwargs = _aliased(kwargs)
        unknown = sorted(set(kwargs) - set(type(self).model_fields))
        if unknown:
            raise TypeError(
                f"RagKVLLM got unsupported settings {unknown}: it runs the engine's local model; supported: "
                f"max_tokens, max_new_tokens, temperature, top_p, top_k, seed, stop, context_window, "
                f"chat_template, reuse_chunks, and LlamaIndex's LLM fields"
            )
        engine = engine if engine is not None else _bridge.default_engine()
        window = kwargs.get("context_window")
        if window is not None and window > engine.max_context:
            raise ValueError(
                f"context_window={window} exceeds the model's context length {engine.max_context}; "
                "pass a smaller one or leave it unset"
            )
        super().__init__(engine=engine, **kwargs)
        install()

    @classmethod
    def class_name(cls) -> str:
        return "RagKVLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.engine.max_context,
            num_output=self.max_new_tokens,
            is_chat_model=self.engine.has_chat_template,
            model_name=self.engine.model_name,
        )

    # ---- prompts and generation ----------------------------------------------------------------
    def _generation(self, kwargs: dict[str, Any]) -> GenerationConfig:
        for k in sorted(set(kwargs) - _CALL_KEYS):
            if k not in _warned_kwargs:
                _warned_kwargs.add(k)
                logger.warning("RagKVLLM ignores the per-call keyword %r (not a generation setting)", k)
        kwargs = _aliased({k: v for k, v in kwargs.items() if k in _CALL_KEYS})
        over = {k: v for k, v in kwargs.items() if k in _GEN_KEYS and v is not None}
        if "stop" in over:
            over["stop"] = tuple(over["stop"])
        base = dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop),
            seed=self.seed,
        )
        return GenerationConfig(**{**base, **over})

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return self.engine.render_completion(prompt, chat_template=self.chat_template and not formatted)

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return self.engine.render_chat([_message_dict(m) for m in messages])

    def _deltas(self, prompt: str, kwargs: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """``(delta, None)`` per piece of text, then ``("", stats)``; stats also go to the open sinks."""
        sinks = current_sinks()  # captured now: a stream may be consumed after the caller returned
        gen = self._generation(kwargs)

        def run() -> Iterator[tuple[str, dict[str, Any] | None]]:
            first: float | None = None
            for delta, stats in _bridge.stream(self.engine, prompt, gen, reuse_chunks=self.reuse_chunks):
                if stats is None:
                    first = first or time.perf_counter()
                    yield delta, None
                else:
                    d = stats.as_dict()
                    record(sinks, d, first or time.perf_counter())
                    yield "", d

        return run()

    # ---- completion ----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats = _bridge.collect(self._deltas(self._completion_prompt(prompt, formatted), kwargs))
        return CompletionResponse(text=text, additional_kwargs={_bridge.STATS_KEY: stats})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        deltas = self._deltas(self._completion_prompt(prompt, formatted), kwargs)
        return _completion_gen(deltas)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        deltas = self._deltas(self._completion_prompt(prompt, formatted), kwargs)
        text, stats = await asyncio.to_thread(_bridge.collect, deltas)
        return CompletionResponse(text=text, additional_kwargs={_bridge.STATS_KEY: stats})

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        deltas = self._deltas(self._completion_prompt(prompt, formatted), kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async for item in _bridge.aiterate(lambda: _completion_gen(deltas)):
                yield item

        return gen()

    # ---- chat ----------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats = _bridge.collect(self._deltas(self._chat_prompt(messages), kwargs))
        return _chat_response(text, None, stats)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return _chat_gen(self._deltas(self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        deltas = self._deltas(self._chat_prompt(messages), kwargs)
        text, stats = await asyncio.to_thread(_bridge.collect, deltas)
        return _chat_response(text, None, stats)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        deltas = self._deltas(self._chat_prompt(messages), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for item in _bridge.aiterate(lambda: _chat_gen(deltas)):
                yield item

        return gen()


def _completion_gen(deltas: Iterator[tuple[str, dict[str, Any] | None]]) -> CompletionResponseGen:
    text = ""
    for delta, stats in deltas:
        text += delta
        # the last item has an empty delta and carries the stats
        extra = {_bridge.STATS_KEY: stats} if stats is not None else {}
        yield CompletionResponse(text=text, delta=delta, additional_kwargs=extra)


def _chat_response(text: str, delta: str | None, stats: dict[str, Any] | None) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
        delta=delta,
        additional_kwargs={_bridge.STATS_KEY: stats} if stats is not None else {},
    )


def _chat_gen(deltas: Iterator[tuple[str, dict[str, Any] | None]]) -> ChatResponseGen:
    text = ""
    for delta, stats in deltas:
        text += delta
        yield _chat_response(text, delta, stats)


def _node_texts(nodes: Sequence[NodeWithScore]) -> list[str]:
    return [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]


class RagKVNodePostprocessor(BaseNodePostprocessor):
    """Registers each retrieved node's prompt text with the engine and makes sure its cache is stored.

    Nodes pass through unchanged. The text registered is what the synthesizer puts into the prompt
    (the node's content in ``MetadataMode.LLM``); missing caches are computed and stored now (so a
    node from any vector store is cached from its first query on), present ones are promoted to
    the fast tiers.

    Building caches is the first query's extra cost (a prefill per new node): it shows a progress
    bar, and its time goes to the response's stats as ``cache_build_ms`` / ``caches_built``.

    Args:
        engine: the ragkv engine the LLM uses (default: the process-wide default engine).
        warm_caches: False only registers the texts (caches are then computed when first used).
        progress: show a progress bar while chunk caches are built.
    """

    engine: Any = Field(default=None, exclude=True, description="the ragkv.engine.RagKV the LLM uses")
    warm_caches: bool = Field(default=True, description="compute and store missing chunk caches now")
    progress: bool = Field(default=True, description="progress bar while chunk caches are built")

    def __init__(self, engine: RagKV | None = None, **kwargs: Any) -> None:
        engine = engine if engine is not None else _bridge.default_engine()
        super().__init__(engine=engine, **kwargs)  # type: ignore[call-arg]  # a pydantic field

    @classmethod
    def class_name(cls) -> str:
        return "RagKVNodePostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        texts = _node_texts(nodes)
        if self.warm_caches:
            t0 = time.perf_counter()
            built = _bridge.warm(self.engine, texts, progress=self.progress)
            record_build((time.perf_counter() - t0) * 1000, built)
        else:
            _bridge.registry(self.engine).add(texts)
        return nodes

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)


class RagKVRetriever(BaseRetriever):
    """Retrieves from ragkv's own index (documents indexed with ``RagKV.index``).

    Nodes carry the chunk text alone (metadata is kept out of the LLM's view), so the prompt holds
    exactly the text whose cache was precomputed at index time; the texts are registered, so no
    postprocessor is needed.

    Args:
        engine: the ragkv engine (default: the process-wide default engine).
        k: chunks per query (default: the engine's ``top_k``).
    """

    def __init__(self, engine: RagKV | None = None, k: int | None = None, **kwargs: Any) -> None:
        if k is not None and k < 1:
            raise ValueError("k must be >= 1 (chunks per query)")
        super().__init__(**kwargs)
        self.engine = engine if engine is not None else _bridge.default_engine()
        self.k = k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        chunks = self.engine.retrieve(query_bundle.query_str, self.k)
        nodes = []
        for c in chunks:
            meta = {"source": c.source, "ordinal": c.ordinal, "doc_id": c.doc_id}
            node = TextNode(
                id_=c.chunk_id,
                text=c.text,
                metadata=meta,
                excluded_llm_metadata_keys=list(meta),
                excluded_embed_metadata_keys=list(meta),
            )
            nodes.append(NodeWithScore(node=node, score=c.score))
        _bridge.registry(self.engine).add(_node_texts(nodes))
        return nodes

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class RagKVEmbedding(BaseEmbedding):
    """The engine's own text embedder (bundled MiniLM by default) as a LlamaIndex embed model.

    Lets a ``VectorStoreIndex`` run offline with ragkv's defaults instead of a hosted embedder.

    Args:
        engine: the ragkv engine whose ``embedder`` to use (default: the process-wide default engine).
    """

    engine: Any = Field(default=None, exclude=True, description="the ragkv.engine.RagKV whose embedder to use")

    def __init__(self, engine: RagKV | None = None, **kwargs: Any) -> None:
        engine = engine if engine is not None else _bridge.default_engine()
        kwargs.setdefault("model_name", getattr(engine.embedder, "fingerprint", "ragkv"))
        super().__init__(engine=engine, **kwargs)  # type: ignore[call-arg]  # a pydantic field

    @classmethod
    def class_name(cls) -> str:
        return "RagKVEmbedding"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return [[float(x) for x in row] for row in self.engine.embedder.embed(list(texts))]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)
