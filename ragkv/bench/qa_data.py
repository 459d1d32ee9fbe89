"""The QA set of ``ragkv bench qa``: invented documents, questions with gold answers, and their RAG prompts.

The shipped set (``data/qa_invented.json``) was written for ragkv: ten documents about invented
subjects of an imaginary sea (islands, companies, species, protocols, people), so no model can
answer from memory, and 36 questions with short gold answers (aliases listed). A question names
the documents it needs (two for a third of them), the documents holding a near-miss fact about
another entity, and whether its answer is computed (arithmetic on facts) rather than a span.

A second set of the same shape, ``data/qa_heldout.json`` (an imaginary mountain range), is held
out: fusion defaults are chosen on the invented set and only reported on this one, never tuned on it.

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

__all__ = ["QA_SETS", "QA_SYSTEM", "QADocument", "QAQuestion", "QASet", "build_prompt", "load_qa_set"]

# The shipped sets by name, files of ``ragkv/bench/data``; "invented" is the one defaults are tuned on.
QA_SETS = {"invented": "qa_invented.json", "heldout": "qa_heldout.json"}

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
        """A set from its JSON form; raises ValueError naming what is missing, repeated or refers to nothing."""
        try:
            docs = {d["id"]: QADocument(d["id"], d["title"], d["text"]) for d in data["documents"]}
            questions = [_question(q) for q in data["questions"]]
        except (KeyError, TypeError, AttributeError) as e:  # a missing key, or a list where an object belongs
            raise ValueError(f"not a QA set ({type(e).__name__}: {e}); {_SCHEMA}") from e
        if len(docs) != len(data["documents"]) or len({q.id for q in questions}) != len(questions):
            raise ValueError(f"document ids and question ids must each be unique; {_SCHEMA}")
        for rec in questions:
            unknown = [d for d in (*rec.docs, *rec.near_miss) if d not in docs]
            if unknown or not rec.answers or not rec.docs:
                raise ValueError(
                    f"question {rec.id!r}: needs at least one answer and one document, and documents that exist "
                    f"(unknown: {unknown}; known: {sorted(docs)})"
                )
        return cls(str(data.get("name", "")), docs, tuple(questions))


_SCHEMA = (
    'a set is {"name", "documents": [{"id", "title", "text"}], "questions": [{"id", "question", '
    '"answers": [...], "docs": [...], "near_miss": [...], "computed": false}]}, as ragkv/bench/data/qa_invented.json'
)


def _question(q: Mapping[str, Any]) -> QAQuestion:
    return QAQuestion(
        id=q["id"],
        question=q["question"],
        answers=tuple(q["answers"]),
        docs=tuple(q["docs"]),
        near_miss=tuple(q.get("near_miss", ())),
        computed=bool(q.get("computed", False)),
    )


def load_qa_set(path: str | Path | None = None) -> QASet:
    """A shipped QA set by name (a key of :data:`QA_SETS`), a JSON file's path, or the invented set when None.

    Raises ValueError saying what is wrong: neither a set's name nor a file, not JSON, not a QA set.
    """
    if path is None or str(path) in QA_SETS:
        name = QA_SETS[str(path or "invented")]
        text = resources.files("ragkv.bench").joinpath("data", name).read_text(encoding="utf-8")
        return QASet.from_dict(json.loads(text))
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"{str(path)!r} is neither a shipped QA set ({', '.join(sorted(QA_SETS))}) nor a file: "
            "give one of those names or the path of a JSON file"
        )
    try:
        return QASet.from_dict(json.loads(file.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not JSON ({e}); fix the file or give a shipped set's name") from e
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


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
