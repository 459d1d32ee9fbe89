"""LangChain's standard test suites for ChatRagKV and RagKVRetriever, on the tiny random model.

The suites build a model from ``chat_model_params`` many times; every instance shares one
indexed engine (module-scoped), bound to the test instance by an autouse fixture because the
suites read their parameters from properties. Answers of the random model are gibberish, which
the suites accept: they check types, streaming protocol, usage and stop handling, not content.
Tool calling, structured output, JSON mode and multimodal inputs are declared unsupported (the
suites then skip those tests).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from ragkv.integrations.langchain import ChatRagKV, RagKVRetriever, register_texts  # noqa: E402
from tests.integrations.conftest import DOCS  # noqa: E402

# The integration suite's async tests carry no asyncio mark of their own (partner packages run
# them with asyncio_mode=auto); mark the class instead and silence the note on its sync tests.
ASYNC_SUITE = [pytest.mark.asyncio, pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")]


class _BoundEngine:
    engine: Any = None

    @pytest.fixture(autouse=True)
    def _bind_engine(self, indexed_rag):
        self.engine = indexed_rag


class TestChatRagKVUnit(_BoundEngine, ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatRagKV]:
        return ChatRagKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.engine}  # the unit suite passes max_tokens itself

    @property
    def supports_model_override(self) -> bool:
        return False  # one loaded model per engine; a different model= raises ValueError

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools is overridden only to say why it is unsupported


class TestChatRagKVIntegration(_BoundEngine, ChatModelIntegrationTests):
    pytestmark = ASYNC_SUITE

    @property
    def chat_model_class(self) -> type[ChatRagKV]:
        return ChatRagKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.engine, "max_tokens": 8}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        details = ["cache_read_input", "cache_creation_input"]
        return {"invoke": details, "stream": details}

    def _rag_question(self, text: str, *, stream: bool) -> AIMessage:
        register_texts(self.engine, [text])
        model = ChatRagKV(engine=self.engine, max_tokens=4)
        message = [HumanMessage(f"Context:\n{text}\n\nQuestion: what is this about?")]
        if not stream:
            return model.invoke(message)
        full = None
        for chunk in model.stream(message):
            full = chunk if full is None else full + chunk
        return full

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        text = DOCS[2].text[:160]
        self._rag_question(text, stream=stream)  # computes and stores the chunk's cache
        msg = self._rag_question(text, stream=stream)
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        # a text never seen before: its cache is created by this call
        msg = self._rag_question(f"A fresh note, number {uuid.uuid4().hex}: " + DOCS[1].text[:120], stream=stream)
        assert msg.usage_metadata["input_token_details"]["cache_creation"] > 0
        return msg


class TestRagKVRetrieverIntegration(_BoundEngine, RetrieversIntegrationTests):
    pytestmark = ASYNC_SUITE

    @property
    def retriever_constructor(self) -> type[RagKVRetriever]:
        return RagKVRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"engine": self.engine}

    @property
    def retriever_query_example(self) -> str:
        return "Where do apples grow?"
