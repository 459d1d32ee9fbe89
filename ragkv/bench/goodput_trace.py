"""The RAG trace ``ragkv bench goodput`` replays: prompts of 3-5 chunks drawn with a Zipf skew, and a question.

The corpus is every chunk of the ``packages`` prompt set's documents (PyPI descriptions of ragkv's
dependencies) and of the stdlib demo documents, cut by ragkv's chunker to ``chunk_tokens`` at most
(a few hundred chunks at the default 384). Each chunk gets a popularity rank from a seeded shuffle
and is drawn with weight ``1 / rank ** zipf``, so a few chunks recur in many prompts while most
appear rarely, as retrieved passages do in a RAG service's traffic. A request draws 3-5 distinct
chunks, laid out in the order drawn (the most popular tend to come first, as a retriever ranks the
best hits first), then a cloze question on the first chunk. The same seed gives the same trace.

A trace can be written to and read from JSONL (one ``{"chunks": [...], "question": ...}`` per
line). Every prompt, rendered with the model's chat template, plus the answer tokens, must fit the
context: a longer one is refused with its line number before any server starts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TraceRequest",
    "build_trace",
    "check_context",
    "gguf_token_counters",
    "load_trace",
    "render_prompt",
    "save_trace",
    "trace_corpus",
    "zipf_weights",
]

_HEAD = "Context information is below.\n---------------------\n"
_TAIL = "---------------------\nGiven the context information and not prior knowledge, answer the query.\n"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace."""

    chunks: tuple[str, ...]  # the retrieved chunk texts, in retrieval order
    question: str  # the user's question, after the chunks
    chunk_ids: tuple[int, ...] = ()  # the chunks' corpus indices (empty for a loaded trace)

    @property
    def prompt(self) -> str:
        """The user message both servers receive."""
        return render_prompt(self.chunks, self.question)


def render_prompt(chunks: Sequence[str], question: str) -> str:
    """The user message: a header, each chunk then a blank line (as ragkv lays chunks out), the question.

    Chunks end with ragkv's separator (a blank line) so ragkv's prompt matcher finds each chunk in
    the form whose cache was computed at index time (see ``ragkv.matching``).
    """
    context = "".join(chunk + "\n\n" for chunk in chunks)
    return f"{_HEAD}{context}{_TAIL}Query: {question}\nAnswer: "


def trace_corpus(count_tokens: Callable[[str], int], chunk_tokens: int = 384) -> list[str]:
    """Chunk texts (stripped, 64 tokens or more) of the packages and stdlib demo documents.

    Args:
        count_tokens: the model's token count of a text.
        chunk_tokens: largest chunk; chunks are cut at paragraph/sentence bounds from half of it up.

    Raises:
        ValueError: If fewer than 20 chunks come out (documents missing on this machine).
    """
    from ragkv.bench.prompt_sets import package_documents
    from ragkv.retriever.chunker import Chunker, ChunkerConfig
    from ragkv.retriever.corpus import stdlib_corpus

    texts = [text for _, text in package_documents()] + [d.text for d in stdlib_corpus()]
    chunker = Chunker(count_tokens, ChunkerConfig(min_tokens=chunk_tokens // 2, max_tokens=chunk_tokens))
    chunks = [span.text.strip() for text in texts for span in chunker.split(text)]
    chunks = [c for c in chunks if count_tokens(c) >= 64]
    if len(chunks) < 20:
        raise ValueError(f"the trace corpus has {len(chunks)} chunks (needs 20): install ragkv's dependencies")
    return list(dict.fromkeys(chunks))  # a repeated paragraph would be one chunk indexed twice


def zipf_weights(n: int, skew: float) -> list[float]:
    """Weights ``1 / rank ** skew`` for ranks 1..n (skew 0: uniform)."""
    if skew < 0:
        raise ValueError(f"the Zipf skew must be >= 0; got {skew}")
    return [1.0 / (rank**skew) for rank in range(1, n + 1)]


def build_trace(corpus: Sequence[str], n: int, *, skew: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests over ``corpus``: 3-5 distinct chunks each, drawn by Zipf popularity, and a question.

    Args:
        corpus: chunk texts (:func:`trace_corpus`).
        n: number of requests.
        skew: the Zipf exponent of chunk popularity (1.0: the rank-1 chunk is drawn twice as often
            as rank 2; 0: uniform).
        seed: the same seed gives the same trace.
    """
    if len(corpus) < 5:
        raise ValueError(f"a trace needs at least 5 chunks in its corpus; got {len(corpus)}")
    rng = random.Random(seed)
    ranked = list(range(len(corpus)))
    rng.shuffle(ranked)  # ranked[r] is the corpus index of the chunk of popularity rank r + 1
    weights = zipf_weights(len(corpus), skew)
    requests = []
    for i in range(n):
        picks = _draw_distinct(rng, len(corpus), weights, rng.randint(3, 5))
        ids = tuple(ranked[p] for p in picks)
        chunks = tuple(corpus[j] for j in ids)
        requests.append(TraceRequest(chunks, _question(chunks[0], offset=i), ids))
    return requests


def _draw_distinct(rng: random.Random, n: int, weights: Sequence[float], k: int) -> list[int]:
    """``k`` distinct ranks (0-based) drawn one after another with ``weights`` (without replacement)."""
    left = list(range(n))
    left_w = list(weights)
    picks = []
    for _ in range(k):
        j = rng.choices(range(len(left)), weights=left_w)[0]
        picks.append(left.pop(j))
        left_w.pop(j)
    return picks


def _question(chunk: str, offset: int) -> str:
    """A cloze question on one sentence of ``chunk`` (the prompt sets' rule), or a summary question."""
    from ragkv.bench.prompt_sets import _cloze, _sentences

    sentences = _sentences(chunk)
    for k in range(len(sentences)):
        made = _cloze(sentences[(offset + k) % len(sentences)])
        if made is not None:
            return f'The first document has this sentence: "{made[0]}" Which word is missing where the blank ____ is?'
    return "What is the first document about? Answer in one sentence."


def save_trace(requests: Sequence[TraceRequest], path: Path) -> None:
    """Write ``requests`` as JSONL, one ``{"chunks", "question"}`` object per line."""
    lines = [json.dumps({"chunks": list(r.chunks), "question": r.question}) for r in requests]
    path.write_text("\n".join(lines) + "\n")


def load_trace(path: Path) -> list[TraceRequest]:
    """The requests of a JSONL trace; a line that is not ``{"chunks": [str, ...], "question": str}`` raises.

    Raises:
        ValueError: naming the file and line of the first bad request.
    """
    requests = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
        chunks, question = row.get("chunks") if isinstance(row, dict) else None, row.get("question")
        if not (isinstance(chunks, list) and chunks and all(isinstance(c, str) for c in chunks)):
            raise ValueError(f"{path}:{line_no}: 'chunks' must be a non-empty list of strings")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{path}:{line_no}: 'question' must be a non-empty string")
        requests.append(TraceRequest(tuple(chunks), question))
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    return requests


def check_context(
    requests: Sequence[TraceRequest], prompt_tokens: Callable[[str], int], context: int, max_tokens: int, where: str
) -> int:
    """The longest prompt's tokens; raises when a prompt plus ``max_tokens`` does not fit ``context``.

    Args:
        requests: the trace.
        prompt_tokens: tokens of a user message rendered with the model's chat template.
        context: the context size both servers get (tokens per request).
        max_tokens: answer tokens per request.
        where: the trace's name in messages (a file's path; line numbers count its requests).

    Raises:
        ValueError: naming the first request (line) that does not fit, its size and the context.
    """
    longest = 0
    for line_no, request in enumerate(requests, 1):
        tokens = prompt_tokens(request.prompt)
        if tokens + max_tokens > context:
            raise ValueError(
                f"{where}:{line_no}: the prompt has {tokens} tokens; with --max-tokens {max_tokens} it exceeds "
                f"the context of {context} tokens: raise --ctx, or use fewer or shorter chunks"
            )
        longest = max(longest, tokens)
    return longest


def gguf_token_counters(gguf: Path) -> tuple[Callable[[str], int], Callable[[str], int]]:
    """(tokens of a text, tokens of a user message rendered with the chat template) for the GGUF's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def text_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    def prompt_tokens(message: str) -> int:
        if not getattr(tok, "chat_template", None):
            return text_tokens(message) + 16
        ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    return text_tokens, prompt_tokens
