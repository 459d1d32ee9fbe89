"""How a RAG prompt is laid out as token segments.

A prompt is ``prefix | chunk_1 | ... | chunk_k | suffix``. The prefix (system prompt and the
opening of the user turn) is shared by every query, so chunk caches are computed after it. Each
chunk and the suffix are tokenized segment by segment, so a chunk's tokens are the same at index
time and at query time (no separator that tokenizes differently in context).

:func:`render_chat` renders a chat (``{"role", "content"}`` messages) with the tokenizer's template:
the form the server and the framework integrations cut into segments around cached chunk texts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PromptLayout", "DEFAULT_SYSTEM", "render_chat", "render_completion"]

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents given. Be brief and precise."
)
_SENTINEL = "\x00RAGKV_CONTENT\x00"


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """The texts around the chunks, rendered once from the tokenizer's chat template."""

    prefix: str  # system turn + opening of the user turn + documents preamble
    chunk_end: str  # written after each chunk's text
    question_start: str  # written before the question
    suffix_end: str  # after the question: end of the user turn and the generation prompt

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, system: str = DEFAULT_SYSTEM) -> PromptLayout:
        """Split the chat template around the user message; a plain text layout without a template."""
        preamble = "Documents:\n\n"
        if getattr(tokenizer, "chat_template", None):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}]
            rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            before, after = rendered.split(_SENTINEL)
            return cls(prefix=before + preamble, chunk_end="\n\n", question_start="Question: ", suffix_end=after)
        bos = tokenizer.bos_token or ""
        return cls(
            prefix=f"{bos}{system}\n\n{preamble}", chunk_end="\n\n", question_start="Question: ", suffix_end="\nAnswer:"
        )

    def chunk_text(self, text: str) -> str:
        """The exact text a chunk contributes to the prompt: stripped (frameworks strip node text
        too, so their prompts contain the same text), then a blank line."""
        return text.strip() + self.chunk_end

    def suffix_text(self, question: str) -> str:
        """The exact text after the chunks."""
        return self.question_start + question + self.suffix_end


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt string of ``messages`` (``{"role", "content"}`` dicts), ready for the assistant's turn.

    Uses the tokenizer's chat template; without one, a plain ``role: content`` transcript.
    """
    if not messages:
        raise ValueError("no messages to answer; pass at least one user message")
    if getattr(tokenizer, "chat_template", None):
        return str(
            tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def render_completion(tokenizer: Any, prompt: str, *, chat_template: bool) -> str:
    """``prompt`` as one user turn of the chat template, or as is (raw completion)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, [{"role": "user", "content": prompt}])
    return prompt
