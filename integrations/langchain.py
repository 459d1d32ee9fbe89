"""LangChain integration: a chat model and an LLM that reuse ragkv chunk caches, and a retriever.

``ragkv.integrations.langchain.RagKVLLM`` and ``RagKVRetriever`` are LangChain classes; the
LlamaIndex ones of the same names live in ``ragkv.integrations.llamaindex``.

Install with ``pip install 'ragkv[langchain]'``. Typical use (an LCEL RAG chain)::

    rag = RagKV()
    retriever = RagKVRetriever(engine=rag, k=4)
    chain = {"context": retriever | join_docs, "question": RunnablePassthrough()} | prompt | ChatRagKV(engine=rag)
    msg = chain.invoke("...")
    msg.response_metadata["ragkv"]  # ttft_ms, reused / recomputed / prefilled chunk tokens, cache hits

The retriever registers every chunk text it returns with the engine; the models render the
messages (or prompt) with the tokenizer's chat template, find the registered texts in it however
the chain joined them, load their caches and prefill only the rest. A prompt with no known chunk
is generated exactly as by the plain model. ``register_texts(engine, texts)`` registers texts
that reach the prompt another way (documents from another retriever).

Stats: ``AIMessage.response_metadata["ragkv"]`` and ``usage_metadata`` (cache-hit chunk tokens
as ``input_token_details.cache_read``, chunks computed now as ``cache_creation``); for the LLM,
``generation_info["ragkv"]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ragkv.integrations._lazy import missing_framework

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.language_models import BaseChatModel, LangSmithParams
    from langchain_core.language_models.llms import LLM
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import (
        ChatGeneration,
        ChatGenerationChunk,
        ChatResult,
        Generation,
        GenerationChunk,
        LLMResult,
    )
    from langchain_core.retrievers import BaseRetriever
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise missing_framework("langchain", "langchain", "langchain-core") from e

from pydantic import BaseModel, ConfigDict, Field

from ragkv.engine import RagKV
from ragkv.generation import GenerationConfig
from ragkv.integrations import _bridge

__all__ = ["ChatRagKV", "RagKVLLM", "RagKVRetriever", "register_texts"]

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool"}
Stats = dict[str, Any]
logger = logging.getLogger(__name__)
# Standard LangChain settings of hosted models that mean nothing for a local model in this
# process: accepted (the standard test suites pass them) and ignored with a logged warning.
_IGNORED = frozenset({"timeout", "request_timeout", "max_retries", "api_key"})
_NO_TOOLS = (
    "ChatRagKV does not support tool calling: it runs a small local model through ragkv's generation "
    "loop, which has no tool-call parsing or constrained decoding; put tool results in the prompt instead"
)


def _check_settings(cls: type[BaseModel], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the ignored hosted-model settings; anything else unknown raises TypeError."""
    for k in sorted(_IGNORED & set(kwargs)):
        kwargs.pop(k)
        logger.warning("%s ignores %s=: generation runs locally, with no API and no network call", cls.__name__, k)
    if "model_kwargs" in kwargs:
        raise TypeError(
            f"{cls.__name__} takes no model_kwargs: pass the settings themselves "
            "(max_tokens, temperature, top_p, top_k, seed, stop)"
        )
    known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"{cls.__name__} got unsupported settings {unknown}; supported: engine, max_tokens, temperature, "
            "top_p, top_k, seed, stop, reuse_chunks, and LangChain's callbacks/tags/metadata"
        )
    return kwargs


def register_texts(engine: RagKV, texts: Sequence[str]) -> None:
    """Tell ``engine``'s models that these texts may appear in prompts (so their caches are used)."""
    _bridge.registry(engine).add(texts)


def _message_dict(m: BaseMessage) -> dict[str, str]:
    role = m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, m.type)
    return {"role": role, "content": m.text}


class _RagKVModel(BaseModel):
    """Settings and the generate loop shared by the chat model and the LLM (a pydantic mixin)."""

    model_config = ConfigDict(populate_by_name=True)

    engine: Any = Field(default=None, exclude=True, description="the ragkv.engine.RagKV that generates")
    model_name: str | None = Field(default=None, alias="model")
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] | None = None
    reuse_chunks: bool = True  # False: prefill every prompt whole (a baseline)

    def __init__(self, engine: RagKV | None = None, **kwargs: Any) -> None:
        super().__init__(engine=engine, **_check_settings(type(self), kwargs))
        self._check_model()

    def _engine(self) -> RagKV:
        return self.engine if self.engine is not None else _bridge.default_engine()

    def _base_params(self) -> dict[str, Any]:
        """What LangChain identifies every ragkv model by; each class adds its own settings."""
        return {"model_name": self._name(), "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _name(self) -> str:
        """The model that really generates (``model=`` may only repeat it)."""
        if self.engine is not None:
            return self.engine.model_name
        from ragkv.config import EngineConfig

        return EngineConfig.from_env().model  # what default_engine() would load

    def _check_model(self) -> None:
        if self.model_name is not None and self.model_name != self._name():
            raise ValueError(
                f"model={self.model_name!r} is not the model this engine runs ({self._name()!r}); "
                "drop model= or build a RagKV engine for that model (EngineConfig(model=...))"
            )

    def _generation(self, stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationConfig:
        model = kwargs.get("model")
        if model is not None and model != self._name():
            raise ValueError(
                f"this model serves {self._name()!r}; build a RagKV engine for {model!r} and "
                "another model object on it instead of passing model= per call"
            )
        stops = [*(self.stop or []), *(stop or [])]
        return GenerationConfig(
            max_new_tokens=kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_tokens,
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            top_k=kwargs.get("top_k", self.top_k),
            stop=tuple(dict.fromkeys(s for s in stops if s)),
            seed=kwargs.get("seed", self.seed),
        )

    def _deltas(self, prompt: str, gen: GenerationConfig) -> Iterator[tuple[str, Stats | None]]:
        for delta, stats in _bridge.stream(self._engine(), prompt, gen, reuse_chunks=self.reuse_chunks):
            yield delta, (stats.as_dict() if stats is not None else None)

    def _finish(self, stats: Stats, gen: GenerationConfig) -> str:
        return "length" if stats["generated_tokens"] >= gen.max_new_tokens else "stop"

    def _response_metadata(self, stats: Stats, gen: GenerationConfig) -> dict[str, Any]:
        return {
            "model_name": self._name(),
            "model_provider": "ragkv",
            "finish_reason": self._finish(stats, gen),
            _bridge.STATS_KEY: stats,
        }

    def _ls_params(self, stop: list[str] | None, kwargs: dict[str, Any], model_type: str) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ragkv",
            ls_model_name=kwargs.get("model") or self._name(),
            ls_model_type=model_type,  # type: ignore[typeddict-item]
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens") or self.max_tokens,
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params


def _usage(stats: Stats) -> UsageMetadata:
    hit = stats["reused_tokens"] + stats["recomputed_tokens"]
    return UsageMetadata(
        input_tokens=stats["prompt_tokens"],
        output_tokens=stats["generated_tokens"],
        total_tokens=stats["prompt_tokens"] + stats["generated_tokens"],
        input_token_details={"cache_read": hit, "cache_creation": stats["prefilled_chunk_tokens"]},
    )


class ChatRagKV(_RagKVModel, BaseChatModel):
    """A ragkv engine's local model as a LangChain chat model, reusing the caches of registered chunks.

    Tool calling and structured output are not supported (a small local model without them).

    Args:
        engine: the ragkv engine (default: a process-wide ``RagKV()`` with every default).
        model: display name (default: the engine's model name); a per-call ``model=`` must match it.
        max_tokens: answer length cap.
        temperature, top_p, top_k, seed: sampling (temperature 0 = greedy).
        stop: stop strings, merged with each call's ``stop``.
        reuse_chunks: False prefills every prompt whole, like the plain model (a baseline).
    """

    streaming: bool = False  # stream through callbacks on invoke

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any) -> Any:
        """Not supported: see ``_NO_TOOLS`` (raised as the message)."""
        raise NotImplementedError(_NO_TOOLS)

    @property
    def _llm_type(self) -> str:
        return "ragkv-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._base_params(), "top_p": self.top_p, "top_k": self.top_k}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(stop, kwargs, "chat")

    def _prompt(self, messages: list[BaseMessage]) -> str:
        return self._engine().render_chat([_message_dict(m) for m in messages])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        gen = self._generation(stop, kwargs)
        text, stats = _bridge.collect(self._deltas(self._prompt(messages), gen))
        meta = self._response_metadata(stats, gen)
        message = AIMessage(content=text, usage_metadata=_usage(stats), response_metadata=meta)
        return ChatResult(
            generations=[ChatGeneration(message=message)],
            llm_output={"model_name": self._name(), _bridge.STATS_KEY: stats},
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in _bridge.aiterate(lambda: self._chunks(messages, stop, kwargs)):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[ChatGenerationChunk]:
        """One chunk per piece of answer text, then a last empty chunk with usage and stats."""
        gen = self._generation(stop, kwargs)
        for delta, stats in self._deltas(self._prompt(messages), gen):
            if stats is None:
                if delta:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
                continue
            last = AIMessageChunk(
                content="",
                usage_metadata=_usage(stats),
                chunk_position="last",
                response_metadata=self._response_metadata(stats, gen),
            )
            yield ChatGenerationChunk(message=last)


class RagKVLLM(_RagKVModel, LLM):
    """A ragkv engine's local model as a LangChain text LLM, reusing the caches of registered chunks.

    The prompt is wrapped as one user turn of the chat template (``chat_template=False``: raw
    completion). Stats are in each generation's ``generation_info["ragkv"]``.
    """

    chat_template: bool = True  # False: raw completion

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self._base_params(), "chat_template": self.chat_template}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(stop, kwargs, "llm")

    def _prompt(self, prompt: str) -> str:
        return self._engine().render_completion(prompt, chat_template=self.chat_template)

    def _one(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Generation:
        gen = self._generation(stop, kwargs)
        text, stats = _bridge.collect(self._deltas(self._prompt(prompt), gen))
        info = {"finish_reason": self._finish(stats, gen), _bridge.STATS_KEY: stats}
        return Generation(text=text, generation_info=info)

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return self._one(prompt, stop, kwargs).text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return LLMResult(
            generations=[[self._one(p, stop, kwargs)] for p in prompts], llm_output={"model_name": self._name()}
        )

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in _bridge.aiterate(lambda: self._chunks(prompt, stop, kwargs)):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunks(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Iterator[GenerationChunk]:
        gen = self._generation(stop, kwargs)
        for delta, stats in self._deltas(self._prompt(prompt), gen):
            if stats is None:
                if delta:
                    yield GenerationChunk(text=delta)
                continue
            yield GenerationChunk(
                text="", generation_info={"finish_reason": self._finish(stats, gen), _bridge.STATS_KEY: stats}
            )


class RagKVRetriever(BaseRetriever):
    """Retrieves chunks from ragkv's own index as Documents, and registers them with the engine.

    Args:
        engine: the ragkv engine (default: the process-wide default engine).
        k: chunks per query (default: the engine's ``top_k``); ``invoke(query, k=...)`` overrides it.
    """

    engine: Any = Field(default=None, exclude=True, description="the ragkv.engine.RagKV to retrieve from")
    k: int | None = Field(default=None, ge=1)

    def __init__(self, engine: RagKV | None = None, **kwargs: Any) -> None:
        super().__init__(engine=engine, **kwargs)  # type: ignore[call-arg]  # a pydantic field

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        engine = self.engine if self.engine is not None else _bridge.default_engine()
        chunks = engine.retrieve(query, k or self.k)
        register_texts(engine, [c.text for c in chunks])
        return [
            Document(
                page_content=c.text,
                id=c.chunk_id,
                metadata={
                    "source": c.source,
                    "ordinal": c.ordinal,
                    "score": c.score,
                    "doc_id": c.doc_id,
                    "chunk_id": c.chunk_id,
                },
            )
            for c in chunks
        ]
