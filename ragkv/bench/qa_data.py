"""The QA set of ``ragkv bench qa``: invented documents, questions with gold answers, and their RAG prompts.

The shipped set (``data/qa_invented.json``) was written for ragkv: ten documents about invented
subjects of an imaginary sea (islands, companies, species, protocols, people), so no model can
answer from memory, and 36 questions with short gold answers (aliases listed). A question names
the documents it needs (two for a third of them), the documents holding a near-miss fact about
another entity, and whether its answer is computed (arithmetic on facts) rather than a span.

A question's prompt holds the documents it needs plus one or two distractors (near-miss documents
first), in a seeded order, each cut into chunks the way ragkv indexes documents (the engine's
chunker and its default sizes, chunk text stripped).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ragkv.retriever.chunker import Chunker, ChunkerConfig
from ragkv.retriever.kv_retriever import RetrieverConfig

__all__ = ["QA_SYSTEM", "QADocument", "QAQuestion", "QASet", "build_prompt", "load_qa_set"]

# Asks for the short answer gold is written as; the bench uses this instead of the engine's default
# system prompt, whose "be brief" still lets small models answer in a full sentence.
QA_SYSTEM = (
    "Answer the question using only the documents given. Reply with the answer only "
    "(a number, a name or a short phrase), not a full sentence."
)


@dataclass(frozen=True, slots=True)
class QADocument:
    """One invented document."""

    id: str  # short name questions refer to it by
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class QAQuestion:
    """One question and its gold answer."""

    id: str
    question: str
    answers: tuple[str, ...]  # gold aliases, the canonical one first
    docs: tuple[str, ...]  # ids of the documents needed to answer
    near_miss: tuple[str, ...] = ()  # ids of documents with a similar fact about another entity
    computed: bool = False  # the answer is arithmetic on facts of ``docs``, not a span of them


@dataclass(frozen=True, slots=True)
class QASet:
    """Documents by id and the questions over them."""

    name: str
    documents: Mapping[str, QADocument]
    questions: tuple[QAQuestion, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QASet:
        """A set from its JSON form; raises ValueError naming a question that refers to a missing document."""
        docs = {d["id"]: QADocument(d["id"], d["title"], d["text"]) for d in data["documents"]}
        questions = []
        for q in data["questions"]:
            rec = QAQuestion(
                id=q["id"],
                question=q["question"],
                answers=tuple(q["answers"]),
                docs=tuple(q["docs"]),
                near_miss=tuple(q.get("near_miss", ())),
                computed=bool(q.get("computed", False)),
            )
            unknown = [d for d in (*rec.docs, *rec.near_miss) if d not in docs]
            if unknown or not rec.answers or not rec.docs:
                raise ValueError(
                    f"question {rec.id!r}: needs at least one answer and one document, and documents that exist "
                    f"(unknown: {unknown}; known: {sorted(docs)})"
                )
            questions.append(rec)
        return cls(str(data.get("name", "")), docs, tuple(questions))


def load_qa_set(path: str | Path | None = None) -> QASet:
    """The QA set in ``path`` (JSON), or the shipped invented set when None."""
    if path is None:
        text = resources.files("ragkv.bench").joinpath("data", "qa_invented.json").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return QASet.from_dict(json.loads(text))


def pick_documents(
    qa: QASet, question: QAQuestion, *, seed: int = 0, distractors: tuple[int, int] = (1, 2)
) -> list[str]:
    """Ids of the documents in ``question``'s prompt, in prompt order (seeded by ``seed`` and the question).

    The needed documents plus ``distractors[0]..distractors[1]`` others: near-miss documents first,
    then others drawn at random. The order is shuffled, so the document holding the answer is not
    always the first (the first chunk after the shared prefix is exact under every fusion method).
    """
    rng = random.Random(f"{seed}:{question.id}")
    k = rng.randint(*distractors)
    near = [d for d in question.near_miss if d not in question.docs]
    rest = sorted(d for d in qa.documents if d not in question.docs and d not in near)
    extra = near[:k] + rng.sample(rest, max(0, min(k - len(near), len(rest))))
    ids = [*question.docs, *extra]
    rng.shuffle(ids)
    return ids


def document_chunks(text: str, count_tokens: Callable[[str], int], config: ChunkerConfig | None = None) -> list[str]:
    """``text`` cut into chunk texts as ragkv indexes it (the engine's chunker, stripped, empty ones dropped)."""
    chunker = Chunker(count_tokens, config or RetrieverConfig().chunker)
    return [t for t in (s.text.strip() for s in chunker.split(text)) if t]


def build_prompt(
    qa: QASet,
    question: QAQuestion,
    count_tokens: Callable[[str], int],
    *,
    seed: int = 0,
    distractors: tuple[int, int] = (1, 2),
    system: str | None = QA_SYSTEM,
) -> dict[str, Any]:
    """The RAG prompt of ``question``: ``{system, chunks, question, docs}`` (``docs``: ids in prompt order)."""
    ids = pick_documents(qa, question, seed=seed, distractors=distractors)
    chunks = [c for d in ids for c in document_chunks(qa.documents[d].text, count_tokens)]
    return {"system": system, "chunks": chunks, "question": question.question, "docs": ids}


def documents_text(qa: QASet, ids: Sequence[str]) -> str:
    """The texts of documents ``ids``, joined (for checks that an answer appears in them)."""
    return "\n\n".join(qa.documents[d].text for d in ids)
