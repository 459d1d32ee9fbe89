"""Prompt layout: the segments joined are exactly the chat template's rendering of the whole prompt."""

from __future__ import annotations

import pytest

from ragkv.prompt import DEFAULT_SYSTEM, PromptLayout
from tests.conftest import make_tokenizer

CHUNKS = ["  Alpha is the first letter.\n", "Beta\n\nfollows it."]


def _joined(layout: PromptLayout, chunks: list[str], question: str) -> str:
    return layout.prefix + "".join(layout.chunk_text(c) for c in chunks) + layout.suffix_text(question)


@pytest.mark.parametrize("system", [DEFAULT_SYSTEM, "Be terse."])
def test_segments_join_to_the_chat_template_rendering(system):
    tok = make_tokenizer()
    layout = PromptLayout.from_tokenizer(tok, system)
    user = "Documents:\n\n" + "".join(c.strip() + "\n\n" for c in CHUNKS) + "Question: why?"
    whole = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert _joined(layout, CHUNKS, "why?") == whole


def test_without_a_chat_template_the_layout_is_plain_text():
    tok = make_tokenizer()
    tok.chat_template = None
    layout = PromptLayout.from_tokenizer(tok, "Sys.")
    assert _joined(layout, CHUNKS, "why?") == (
        "<s>Sys.\n\nDocuments:\n\nAlpha is the first letter.\n\nBeta\n\nfollows it.\n\nQuestion: why?\nAnswer:"
    )


def test_a_chunk_contributes_the_same_text_wherever_it_sits():
    layout = PromptLayout.from_tokenizer(make_tokenizer())
    assert layout.chunk_text("  x \n") == layout.chunk_text("x") == "x\n\n"
    for i, chunk in enumerate(CHUNKS):
        assert layout.chunk_text(chunk) in _joined(layout, CHUNKS[i:] + CHUNKS[:i], "q")
