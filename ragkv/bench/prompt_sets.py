"""Prompt sets for the benches: ``builtin`` (stdlib pydoc) and ``packages`` (PyPI package descriptions).

The ``packages`` set is text the defaults were not tuned on: the long descriptions (README as
uploaded to PyPI) in the ``METADATA`` of the packages ragkv itself depends on, so every
environment that can run ragkv has them. Markup is stripped (badges, images, HTML, link targets),
each description is chunked like the built-in set (300-512 tokens), and each prompt takes 4-6
chunks from different packages, round-robin.

Each question is a cloze built from one sentence of one chunk (the answer chunk): the sentence's
longest word of at least five letters (the first such on ties, never the sentence's first word)
is replaced by ``____`` and the question asks which word fills the blank. The sentence is the
first eligible one (8-40 words, mostly alphabetic, no URL or table markup) at or after a
prompt-dependent offset, so prompts do not all ask about a chunk's opening line. Every prompt
dict carries ``answer`` (the word) and ``answer_chunk`` (its chunk's index) besides ``system``,
``chunks`` and ``question``; the benches ignore the extras.

The same installed versions give the same prompts, byte for byte: nothing here depends on the
order files are listed in, on time or on randomness.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["PACKAGES", "PROMPT_SETS", "package_documents", "package_prompts", "prompt_set"]

logger = logging.getLogger(__name__)

# Direct dependencies of ragkv (pyproject.toml) whose descriptions hold prose, in a fixed order.
PACKAGES: tuple[str, ...] = (
    "redis",
    "sqlalchemy",
    "tqdm",
    "diskcache",
    "xxhash",
    "fsspec",
    "faiss-cpu",
    "transformers",
    "accelerate",
    "constriction",
    "sentence-transformers",
    "typer",
    "numpy",
    "torch",
)
_MIN_CHARS = 1500  # a description shorter than this (after cleaning) gives no full chunk


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


_DROP_LINE = re.compile(
    r"!\[|\[!\[|^\s*\.\. (image|figure|raw|\|)|^\s*:(target|alt|width|height|align):|^\s*\|.*\|\s*$|^\s*-{3,}\s*$"
)
_HTML_TAG = re.compile(r"<[^>\n]+>")
_MD_LINK = re.compile(r"\[([^\]\n]+)\]\([^)\n]*\)")
_RST_LINK = re.compile(r"`([^`<\n]+?)\s*<[^>\n]+>`_{1,2}")
_RST_ROLE = re.compile(r":[a-z]+:`([^`\n]+)`")
_URL = re.compile(r"https?://\S+")
_BLANKS = re.compile(r"\n{3,}")


def clean_description(text: str) -> str:
    """``text`` (Markdown or reStructuredText) without badges, images, HTML and link targets."""
    lines: list[str] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if _DROP_LINE.search(line):
            continue
        line = _HTML_TAG.sub("", _MD_LINK.sub(r"\1", _RST_LINK.sub(r"\1", line)))  # RST targets look like tags
        line = _RST_ROLE.sub(r"\1", line)
        line = _URL.sub("", line).rstrip()
        if line.strip() or (lines and lines[-1]):
            lines.append(line)
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip() + "\n"


def package_documents(packages: Sequence[str] = PACKAGES) -> list[tuple[str, str]]:
    """(package name, cleaned long description) for each installed package of ``packages``.

    Raises:
        ValueError: If fewer than three of them are installed with a description long enough
            to chunk (the set needs chunks from several sources; install ragkv's dependencies).
    """
    docs = []
    for name in packages:
        try:
            meta = importlib.metadata.distribution(name).metadata
        except importlib.metadata.PackageNotFoundError:
            logger.warning("package %s is not installed; the packages prompt set goes without it", name)
            continue
        text = clean_description(meta.get_payload() or meta.get("Description") or "")  # type: ignore[attr-defined]
        if len(text) >= _MIN_CHARS:
            docs.append((name, text))
    if len(docs) < 3:
        raise ValueError(
            f"the packages prompt set needs the descriptions of at least 3 of {list(packages)}; "
            f"found {len(docs)}: install ragkv's dependencies (pip install ragkv) or use --prompts builtin"
        )
    return docs


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"[A-Za-z]+")


def _sentences(chunk: str) -> list[str]:
    """Eligible cloze sentences of ``chunk``, whitespace-normalized, in text order."""
    out = []
    for paragraph in re.split(r"\n\s*\n", chunk):
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            words = sentence.split()
            alpha = sum(1 for w in words if _WORD.fullmatch(w.strip(".,;:()'\"")))
            if (
                8 <= len(words) <= 40
                and alpha >= 0.7 * len(words)
                and not re.search(r"[|`#*=<>{}_$]|\(\)|://", sentence)
            ):
                out.append(sentence)
    return out


def _cloze(sentence: str) -> tuple[str, str] | None:
    """(sentence with its blank, the blanked word), or None when no word qualifies."""
    words = [(m.start(), m.group()) for m in _WORD.finditer(sentence)][1:]
    words = [(s, w) for s, w in words if len(w) >= 5]
    if not words:
        return None
    start, word = max(words, key=lambda sw: (len(sw[1]), -sw[0]))
    return sentence[:start] + "____" + sentence[start + len(word) :], word


def _question(package: str, chunk: str, offset: int) -> tuple[str, str] | None:
    sentences = _sentences(chunk)
    for k in range(len(sentences)):
        made = _cloze(sentences[(offset + k) % len(sentences)])
        if made is not None:
            blanked, word = made
            question = (
                f'The documents include the description of the Python package {package}. One of its sentences reads: "'
                f'{blanked}" Which word is missing where the blank ____ is? Answer with that word.'
            )
            return question, word
    return None


def package_prompts(adapter: _Encoder, n: int = 12, max_tokens: int = 2800) -> list[dict[str, Any]]:
    """RAG prompts from PyPI package descriptions: 4-6 chunks of 300-512 tokens, a cloze question on one.

    Args:
        adapter: anything with ``encode(text) -> token ids`` (the model adapter), to size chunks.
        n: number of prompts.
        max_tokens: chunks are dropped from the end of a prompt (never its answer chunk) until
            the chunks fit in this many tokens.

    Returns:
        Prompt dicts: ``system`` (None), ``chunks``, ``question``, ``answer``, ``answer_chunk``.

    Raises:
        ValueError: If too few package descriptions are installed (see :func:`package_documents`).
    """
    from ragkv.retriever.chunker import Chunker, ChunkerConfig

    chunker = Chunker(lambda t: len(adapter.encode(t)), ChunkerConfig(min_tokens=300, max_tokens=512))
    per_doc = []
    for name, text in package_documents():
        spans = [s.text for s in chunker.split(text)]
        usable = [(name, c) for c in spans if _sentences(c) and len(adapter.encode(c)) >= 200]
        if usable:
            per_doc.append(usable)
    prompts: list[dict[str, Any]] = []
    for i in range(n):
        k = 4 + i % 3  # 4..6 chunks
        picks = [per_doc[(i + j * 3) % len(per_doc)] for j in range(min(k, len(per_doc)))]
        picks_chunks = [doc[(i // len(per_doc) + j) % len(doc)] for j, doc in enumerate(picks)]
        target = i % len(picks_chunks)
        while sum(len(adapter.encode(t)) for _, t in picks_chunks) > max_tokens and len(picks_chunks) > 2:
            drop = len(picks_chunks) - 1 if target != len(picks_chunks) - 1 else len(picks_chunks) - 2
            picks_chunks.pop(drop)
            target -= drop < target
        package, chunk = picks_chunks[target]
        made = _question(package, chunk, offset=i)
        if made is None:  # unreachable: usable chunks have a sentence with a long word
            raise ValueError(f"no cloze sentence in a chunk of {package}")
        question, word = made
        prompts.append(
            {
                "system": None,
                "chunks": [t for _, t in picks_chunks],
                "question": question,
                "answer": word,
                "answer_chunk": target,
            }
        )
    return prompts


def _builtin(adapter: Any, n: int, max_tokens: int) -> list[dict[str, Any]]:
    from ragkv.bench.fusion import builtin_prompts

    return builtin_prompts(adapter, n=n, max_tokens=max_tokens)


PROMPT_SETS: dict[str, Callable[[Any, int, int], list[dict[str, Any]]]] = {
    "builtin": _builtin,
    "packages": package_prompts,
}


def prompt_set(name: str, adapter: Any, n: int = 12, max_tokens: int = 2800) -> list[dict[str, Any]]:
    """The first ``n`` prompts of the set called ``name`` (a key of :data:`PROMPT_SETS`)."""
    try:
        build = PROMPT_SETS[name]
    except KeyError:
        raise ValueError(
            f"unknown prompt set {name!r}; choose one of {sorted(PROMPT_SETS)} or give a .jsonl file"
        ) from None
    return build(adapter, n, max_tokens)
