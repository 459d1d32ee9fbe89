"""The demo corpus: stdlib pydoc text, stable across machines, with answerable demo questions."""

from __future__ import annotations

import re

import pytest

from ragkv.retriever.corpus import DEFAULT_MODULES, DEMO_QUESTIONS, clean_pydoc, stdlib_corpus


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus()


def test_one_document_per_module(corpus):
    assert [d.source for d in corpus] == [f"pydoc:{m}" for m in DEFAULT_MODULES]
    assert 8 <= len(corpus) <= 12
    by_source = {d.source: d for d in corpus}
    assert by_source["pydoc:heapq"].title == "heapq - Heap queue algorithm (a.k.a. priority queue)."
    assert by_source["pydoc:json"].title == "json"
    for doc in corpus:
        assert doc.text.startswith("NAME\n") and doc.text.endswith("\n") and len(doc.text) > 1000


def test_machine_specific_text_is_removed(corpus):
    for doc in corpus:
        assert not re.search(r"^(FILE|MODULE REFERENCE)$", doc.text, re.MULTILINE)
        assert "Python Library Documentation" not in doc.text
        assert not re.search(r" at 0x[0-9a-f]+", doc.text)
        assert "site-packages" not in doc.text and "/lib/python3" not in doc.text
        assert "\n\n\n" not in doc.text and " \n" not in doc.text


def test_deterministic(corpus):
    assert stdlib_corpus() == corpus


def test_max_chars_per_module():
    docs = stdlib_corpus(["json", "heapq"], max_chars_per_module=500)
    assert all(len(d.text) <= 500 and d.text.endswith("\n") for d in docs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        stdlib_corpus(["no_such_module_xyz"])
    with pytest.raises(TypeError, match="list of names"):
        stdlib_corpus("json")
    with pytest.raises(ValueError, match="max_chars_per_module"):
        stdlib_corpus(["json"], max_chars_per_module=0)


def test_clean_pydoc_drops_dunder_data_and_addresses():
    raw = (
        "Python Library Documentation: module m\n\nNAME\n    m - Demo.\n\nMODULE REFERENCE\n"
        "    https://docs.python.org/3/library/m.html\n\nFUNCTIONS\n"
        "    f(x, default=<object object at 0x7f00deadbeef>)\n    \n\nDATA\n"
        "    ANSWER = 42\n    __all__ = ['f']\n\nFILE\n    /home/me/m.py\n\n"
    )
    assert clean_pydoc(raw) == (
        "NAME\n    m - Demo.\n\nFUNCTIONS\n    f(x, default=<object object>)\n\nDATA\n    ANSWER = 42\n"
    )


def test_demo_questions_name_corpus_modules(corpus):
    assert 4 <= len(DEMO_QUESTIONS) <= 6
    for question in DEMO_QUESTIONS:
        assert any(m in question for m in DEFAULT_MODULES), question


# Where each demo question is answered: (module, a phrase of the answer in its docs).
ANSWERS = {
    "What does json.dumps do with the indent argument?": ("json", "If ``indent`` is a non-negative integer"),
    "How does heapq.heappush work?": ("heapq", "Push item onto heap, maintaining the heap invariant."),
    "What is the difference between statistics.median_low and statistics.median_high?": (
        "statistics",
        "the smaller of the two middle values is returned",
    ),
    "How do I remove common leading whitespace from every line of a string with textwrap?": (
        "textwrap",
        "Remove any common leading whitespace from every line",
    ),
    "What does functools.lru_cache do when maxsize is None?": (
        "functools",
        "If *maxsize* is set to None, the LRU features are disabled",
    ),
    "Which function in shutil copies a whole directory tree?": (
        "shutil",
        "Recursively copy a directory tree",
    ),
}


def test_demo_questions_are_answered_in_the_corpus(corpus):
    assert set(ANSWERS) == set(DEMO_QUESTIONS)
    by_source = {d.source: d.text for d in corpus}
    for question, (module, phrase) in ANSWERS.items():
        text = " ".join(by_source[f"pydoc:{module}"].split())
        assert phrase in text, question
