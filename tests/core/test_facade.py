"""What the front ends read from RagKV (its own methods, not its parts): each equals the part it
stands for, and a tenant's view is its own."""

from __future__ import annotations

from ragkv.prompt import render_chat, render_completion
from tests.core.test_engine import DOCS, _engine


def test_model_facts_and_prompts_come_from_the_loaded_model(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        assert rag.model_name == llama_adapter.name and rag.max_context == llama_adapter.spec.max_context
        assert rag.has_chat_template  # the tiny tokenizer has one
        info = rag.model_info()
        assert info["model"] == llama_adapter.name and info["decode_weights"] == "model"
        assert info["dtype"] == "float32" and info["dtype_reason"]
        chat = [{"role": "user", "content": "Where do apples grow?"}]
        assert rag.render_chat(chat) == render_chat(llama_adapter.tokenizer, chat)
        assert rag.render_completion("hi", chat_template=True) == render_completion(
            llama_adapter.tokenizer, "hi", chat_template=True
        )
        assert rag.render_completion("hi", chat_template=False) == "hi"
        assert rag.encode("apples") == llama_adapter.encode("apples")


def test_documents_chunks_and_store_figures_are_the_tenants_own(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        assert rag.documents() == [] and rag.chunk_texts() == []
        rag.index(DOCS, progress=False)
        other = rag.for_tenant("other")
        assert sorted(d.source for d in rag.documents()) == sorted(d.source for d in DOCS)
        assert other.documents() == [] and other.chunk_texts() == []
        texts = rag.chunk_texts()
        assert texts and all(any(t.strip() in d.text for d in DOCS) for t in texts)
        assert rag.stored_bytes() and not other.stored_bytes()  # the memory tier counts per tenant
        assert set(rag.tier_health()) == set(rag.tier_stats()) and set(rag.tier_health().values()) == {"closed"}
