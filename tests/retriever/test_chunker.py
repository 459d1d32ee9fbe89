"""Chunker: exact tiling, token bounds, boundary preference, overlap, and O(pieces) counting."""

from __future__ import annotations

import pydoc
import re
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragkv.retriever.chunker import Chunker, ChunkerConfig, TextSpan

_TOKEN = re.compile(r"\w+|[^\w\s]")


def count_words(text: str) -> int:
    """Words and punctuation marks: a simple, near-additive stand-in for a tokenizer."""
    return len(_TOKEN.findall(text))


def count_superadditive(text: str) -> int:
    """Grows faster than the sum of its parts, so summed piece counts underestimate a chunk."""
    return count_words(text) + len(text) // 40


class CountingCounter:
    """Wraps a counter and records how often, and on how many characters, it was called."""

    def __init__(self, inner=count_words) -> None:
        self.inner = inner
        self.calls = 0
        self.chars = 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        self.chars += len(text)
        return self.inner(text)


def assert_tiles(text: str, spans: list[TextSpan]) -> None:
    assert "".join(s.text for s in spans) == text
    pos = 0
    for s in spans:
        assert s.start == pos and s.end > s.start and text[s.start : s.end] == s.text
        pos = s.end
    assert pos == len(text)


@pytest.fixture(scope="module")
def doc_text() -> str:
    import json

    return pydoc.render_doc(json, renderer=pydoc.plaintext)


SAMPLE = textwrap.dedent(
    """\
    The first paragraph has two sentences. It is short.

    The second paragraph is a little longer! It has three sentences? Yes it does.

    A third paragraph closes the text.
    """
)


@pytest.mark.parametrize("max_tokens", [3, 8, 16, 40, 1000])
def test_small_text_tiles_exactly_and_respects_max(max_tokens):
    cfg = ChunkerConfig(min_tokens=min(4, max_tokens), max_tokens=max_tokens)
    spans = Chunker(count_words, cfg).split(SAMPLE)
    assert_tiles(SAMPLE, spans)
    assert all(count_words(s.text) <= max_tokens for s in spans)


def test_whole_text_within_budget_is_one_chunk():
    spans = Chunker(count_words, ChunkerConfig(min_tokens=1, max_tokens=1000)).split(SAMPLE)
    assert spans == [TextSpan(0, len(SAMPLE), SAMPLE)]


def test_prefers_paragraph_boundaries():
    # Paragraphs of 10 tokens; a chunk of 25 could hold 2.5 of them, but ends at a paragraph.
    para = "alpha beta gamma delta. epsilon zeta eta theta iota kappa.\n\n"
    text = para * 6
    spans = Chunker(count_words, ChunkerConfig(min_tokens=10, max_tokens=25)).split(text)
    assert_tiles(text, spans)
    assert all(s.text.endswith("\n\n") for s in spans)
    assert [count_words(s.text) for s in spans] == [24, 24, 24]


def test_falls_back_to_sentences_then_words():
    sentence = "one two three four five six seven. "
    text = sentence * 4 + "\n\n"
    spans = Chunker(count_words, ChunkerConfig(min_tokens=4, max_tokens=10)).split(text)
    assert_tiles(text, spans)
    assert [s.text for s in spans[:2]] == [sentence, sentence]  # 8 tokens each: one sentence per chunk
    words = "w " * 50
    spans = Chunker(count_words, ChunkerConfig(min_tokens=5, max_tokens=7)).split(words)
    assert_tiles(words, spans)
    assert [count_words(s.text) for s in spans] == [7] * 7 + [1]


def test_min_tokens_keeps_chunks_from_ending_early():
    # A paragraph break after 2 tokens is not worth a 2-token chunk when min_tokens is 5.
    text = "a b\n\nc d e f g h i j k l m n o p"
    spans = Chunker(count_words, ChunkerConfig(min_tokens=5, max_tokens=8)).split(text)
    assert_tiles(text, spans)
    assert count_words(spans[0].text) == 8


def test_character_fallback_for_a_long_word():
    text = "x" * 1000 + " tail"
    count = CountingCounter(lambda s: -(-len(s) // 4))  # ceil(chars / 4)
    spans = Chunker(count, ChunkerConfig(min_tokens=10, max_tokens=32)).split(text)
    assert_tiles(text, spans)
    assert all(count.inner(s.text) <= 32 for s in spans)
    assert len(spans) == 8  # 1000 x's at 128 chars a chunk, tail packed with the last
    assert count.calls < 200  # bisection, not one call per character


def test_single_character_over_max_is_allowed():
    count = lambda s: sum(3 if ch == "\u5b57" else 1 for ch in s if not ch.isspace())  # noqa: E731
    text = "a \u5b57 b"
    spans = Chunker(count, ChunkerConfig(min_tokens=1, max_tokens=2)).split(text)
    assert_tiles(text, spans)
    assert [s.text for s in spans] == ["a ", "\u5b57 ", "b"]


def test_non_additive_counts_are_verified(doc_text):
    cfg = ChunkerConfig(min_tokens=64, max_tokens=128)
    spans = Chunker(count_superadditive, cfg).split(doc_text)
    assert_tiles(doc_text, spans)
    assert all(count_superadditive(s.text) <= 128 for s in spans)


def test_counts_are_linear_in_pieces(doc_text):
    text = doc_text * 4
    count = CountingCounter()
    spans = Chunker(count, ChunkerConfig(min_tokens=128, max_tokens=256)).split(text)
    assert_tiles(text, spans)
    sentences = len(re.findall(r"[.!?]\s+|\n\s*\n", text))
    assert count.calls < 2 * sentences
    # Each character is measured a bounded number of times (once per level it passes through,
    # plus the verification of its chunk), never once per candidate chunk.
    assert count.chars < 8 * len(text)


def test_real_chunks_are_full(doc_text):
    spans = Chunker(count_words, ChunkerConfig(min_tokens=256, max_tokens=512)).split(doc_text)
    sizes = [count_words(s.text) for s in spans]
    assert all(size >= 256 for size in sizes[:-1])
    assert max(sizes) <= 512


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \n"])
def test_empty_text_is_rejected(text):
    with pytest.raises(ValueError, match="is empty"):
        Chunker(count_words).split(text)


def test_non_string_is_rejected():
    with pytest.raises(TypeError, match="takes a str"):
        Chunker(count_words).split(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": 600, "max_tokens": 512}, "min_tokens must be in"),
        ({"overlap_tokens": 512, "max_tokens": 512}, "overlap_tokens must be in"),
        ({"overlap_tokens": -1}, "overlap_tokens must be in"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkerConfig(**kwargs)


def test_leading_whitespace_is_kept():
    text = "\n\n  Hello there. General Kenobi.\n"
    spans = Chunker(count_words, ChunkerConfig(min_tokens=1, max_tokens=3)).split(text)
    assert_tiles(text, spans)
    assert spans[0].text.startswith("\n\n  Hello")


def assert_overlapping(text: str, spans: list[TextSpan], max_tokens: int, counter=count_words) -> None:
    assert spans[0].start == 0 and spans[-1].end == len(text)
    for prev, cur in zip(spans, spans[1:], strict=False):
        assert prev.start < cur.start <= prev.end  # progress, and no gap
        assert cur.end > prev.end
    for s in spans:
        assert s.text == text[s.start : s.end]
        assert counter(s.text) <= max_tokens


def test_overlap(doc_text):
    cfg = ChunkerConfig(min_tokens=64, max_tokens=128, overlap_tokens=32)
    spans = Chunker(count_words, cfg).split(doc_text)
    assert_overlapping(doc_text, spans, 128)
    overlaps = [count_words(doc_text[b.start : a.end]) for a, b in zip(spans, spans[1:], strict=False)]
    # Overlaps start at word starts, so they are at most 32 and usually close to it.
    assert max(overlaps) <= 32
    assert sorted(overlaps)[len(overlaps) // 2] >= 24


texts = st.lists(
    st.sampled_from(
        ["word", "x", "tok", " ", "  ", "\n", "\n\n", ". ", "! ", "?", "\t", "\u00e9t\u00e9", "\u5b57", "."]
    ),
    min_size=1,
    max_size=120,
).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=texts.filter(str.strip),
    max_tokens=st.integers(1, 30),
    min_frac=st.floats(0, 1),
    superadditive=st.booleans(),
)
def test_property_tiling_and_bound(text, max_tokens, min_frac, superadditive):
    counter = count_superadditive if superadditive else count_words
    cfg = ChunkerConfig(min_tokens=int(min_frac * max_tokens), max_tokens=max_tokens)
    spans = Chunker(counter, cfg).split(text)
    assert_tiles(text, spans)
    for s in spans:
        assert counter(s.text) <= max_tokens or len(s.text.strip()) == 1


@settings(max_examples=100, deadline=None)
@given(text=texts.filter(str.strip), max_tokens=st.integers(2, 30), overlap_frac=st.floats(0, 0.9))
def test_property_overlap(text, max_tokens, overlap_frac):
    overlap = min(max_tokens - 1, int(overlap_frac * max_tokens))
    cfg = ChunkerConfig(min_tokens=0, max_tokens=max_tokens, overlap_tokens=overlap)
    spans = Chunker(count_words, cfg).split(text)
    assert_overlapping(text, spans, max_tokens)
