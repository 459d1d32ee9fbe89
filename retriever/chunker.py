"""Token-aware text chunking that tiles the input exactly.

The chunker cuts text into pieces along the strongest boundaries that keep each piece within
``max_tokens`` (paragraphs, then sentences, then lines, then words, then characters), measures
each piece once, and packs consecutive pieces into chunks by summing the cached counts. Only the
packed chunk is measured again, once, because token counts are close to but not exactly additive
across a cut (a tokenizer may merge or split differently at the seam); a chunk that comes out over
budget is re-packed with a smaller estimate. ``count_tokens`` is thus called O(number of pieces)
times, never once per candidate chunk.

With ``overlap_tokens == 0`` the spans tile the text: ``"".join(s.text for s in spans) == text``.
Each chunk keeps its trailing whitespace, so nothing is lost or duplicated at a cut.

>>> chunker = Chunker(lambda s: len(s.split()), ChunkerConfig(min_tokens=2, max_tokens=3))
>>> [s.text for s in chunker.split("One two. Three four five.\\n\\nSix.")]
['One two. ', 'Three four five.\\n\\n', 'Six.']
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["ChunkerConfig", "Chunker", "TextSpan"]

logger = logging.getLogger(__name__)

# Boundary strengths: the strength of the boundary right after a piece. Packing prefers to end a
# chunk at the strongest boundary it can reach without falling below ``min_tokens``.
_CHAR, _WORD, _LINE, _SENTENCE, _PARAGRAPH, _END = range(6)

# Each pattern matches a separator; a cut goes right after it, so separators (whitespace included)
# stay at the end of the piece they follow.
_PARAGRAPH_SEP = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_SENTENCE_SEP = re.compile(r"[.!?\u2026][\"'\u201d\u2019)\]]*\s+")
_LINE_SEP = re.compile(r"\n\s*")
_WORD_SEP = re.compile(r"\s+")
_LEVELS = ((_PARAGRAPH, _PARAGRAPH_SEP), (_SENTENCE, _SENTENCE_SEP), (_LINE, _LINE_SEP), (_WORD, _WORD_SEP))

# A token rarely spans more characters than this; it bounds the window the character-level
# fallback measures, so one pathological 1 MB "word" is not tokenized whole per cut.
_MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True, slots=True)
class ChunkerConfig:
    """How big chunks are, in tokens of the caller's ``count_tokens``.

    Attributes:
        min_tokens: Chunks prefer not to end below this size (the last chunk may be shorter).
        max_tokens: Hard upper bound on a chunk's token count (unless one character exceeds it).
        overlap_tokens: Tokens each chunk repeats from the end of the previous one (about).
    """

    min_tokens: int = 256
    max_tokens: int = 512
    overlap_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"ChunkerConfig.max_tokens must be >= 1; got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"ChunkerConfig.min_tokens must be in [0, max_tokens={self.max_tokens}]; got {self.min_tokens}"
            )
        if not 0 <= self.overlap_tokens < self.max_tokens:
            raise ValueError(
                f"ChunkerConfig.overlap_tokens must be in [0, max_tokens={self.max_tokens}); "
                f"got {self.overlap_tokens}. Lower it (a quarter of max_tokens is typical)."
            )


@dataclass(frozen=True, slots=True)
class TextSpan:
    """A chunk of a text: ``text == source[start:end]`` (character offsets)."""

    start: int  # offset of the first character, inclusive
    end: int  # offset past the last character, exclusive
    text: str  # the characters themselves, trailing whitespace included


@dataclass(frozen=True, slots=True)
class _Piece:
    """An atomic unit for packing: never cut further, measured once."""

    start: int
    end: int
    tokens: int  # count_tokens of the piece on its own
    boundary: int  # strength of the boundary after the piece


class Chunker:
    """Splits text into token-bounded chunks along natural boundaries.

    Args:
        count_tokens: Returns the number of tokens in a string (e.g. ``len(tokenizer.encode(s))``).
        config: Chunk sizes; defaults to ``ChunkerConfig()``.
    """

    def __init__(self, count_tokens: Callable[[str], int], config: ChunkerConfig | None = None) -> None:
        if not callable(count_tokens):
            raise TypeError("count_tokens must be a callable str -> int, e.g. lambda s: len(tok.encode(s))")
        self._count = count_tokens
        self.config = config or ChunkerConfig()

    def split(self, text: str) -> list[TextSpan]:
        """Split ``text`` into chunks.

        Args:
            text: The text to split.

        Returns:
            Character spans in order. With ``overlap_tokens == 0`` they tile ``text`` exactly.

        Raises:
            ValueError: If ``text`` is empty or whitespace only.
        """
        if not isinstance(text, str):
            raise TypeError(f"Chunker.split takes a str; got {type(text).__name__}")
        if not text.strip():
            raise ValueError("text is empty (or whitespace only); pass a document with some content")
        cfg = self.config
        capacity = cfg.max_tokens - cfg.overlap_tokens
        min_core = max(0, cfg.min_tokens - cfg.overlap_tokens)
        pieces = self._pieces(text, capacity)
        cores = self._pack(text, pieces, capacity, min_core)
        spans = [TextSpan(s, e, text[s:e]) for s, e in cores]
        if cfg.overlap_tokens:
            spans = self._add_overlap(text, spans)
        logger.debug("split %d chars into %d pieces and %d chunks", len(text), len(pieces), len(spans))
        return spans

    # -- cutting ---------------------------------------------------------------------------------

    def _pieces(self, text: str, limit: int) -> list[_Piece]:
        """Cut ``text`` into pieces of at most ``limit`` tokens each, coarsest boundaries first."""
        out: list[_Piece] = []
        self._cut(text, 0, len(text), 0, _END, limit, out)
        return out

    def _cut(self, text: str, start: int, end: int, level: int, boundary: int, limit: int, out: list[_Piece]) -> None:
        """Append the pieces of ``text[start:end]``, splitting at ``_LEVELS[level]`` and finer."""
        if level == len(_LEVELS):
            self._cut_chars(text, start, end, boundary, limit, out)
            return
        strength, pattern = _LEVELS[level]
        bounds = _cut_points(text, start, end, pattern)
        for i, (s, e) in enumerate(bounds):
            after = boundary if i == len(bounds) - 1 else strength
            tokens = self._count(text[s:e])
            if tokens <= limit:
                out.append(_Piece(s, e, tokens, after))
            else:
                self._cut(text, s, e, level + 1, after, limit, out)

    def _cut_chars(self, text: str, start: int, end: int, boundary: int, limit: int, out: list[_Piece]) -> None:
        """Last resort: the longest character prefixes within ``limit``, found by bisection."""
        pos = start
        while pos < end:
            hi = min(end, pos + limit * _MAX_CHARS_PER_TOKEN)
            tokens = self._count(text[pos:hi])
            if tokens > limit:
                # Largest cut in (pos, hi) that fits; one character always goes, even if it alone
                # exceeds the limit (nothing smaller exists).
                lo, lo_tokens = pos + 1, self._count(text[pos : pos + 1])
                top = hi - 1
                while lo < top:
                    mid = (lo + top + 1) // 2
                    mid_tokens = self._count(text[pos:mid])
                    if mid_tokens <= limit:
                        lo, lo_tokens = mid, mid_tokens
                    else:
                        top = mid - 1
                hi, tokens = lo, lo_tokens
            if hi < end and not text[hi:end].strip():
                # Keep the word's trailing whitespace with it rather than start a chunk with it.
                whole = self._count(text[pos:end])
                if whole <= max(limit, tokens):
                    hi, tokens = end, whole
            out.append(_Piece(pos, hi, tokens, boundary if hi == end else _CHAR))
            pos = hi

    # -- packing ---------------------------------------------------------------------------------

    def _pack(self, text: str, pieces: list[_Piece], limit: int, min_tokens: int) -> list[tuple[int, int]]:
        """Group consecutive pieces into ``(start, end)`` chunks of at most ``limit`` real tokens."""
        prefix = [0, *accumulate(p.tokens for p in pieces)]  # prefix[i] = tokens of pieces[:i]
        chunks: list[tuple[int, int]] = []
        first = 0
        while first < len(pieces):
            budget = limit
            while True:
                last = _choose_end(pieces, prefix, first, budget, min_tokens)
                start, end = pieces[first].start, pieces[last].end
                if last == first:
                    break  # one piece was measured on its own: its count is exact
                real = self._count(text[start:end])
                if real <= limit:
                    break
                # Counts were not additive at the seams; shrink the estimate by the overshoot and
                # always by at least one token so the loop ends.
                estimate = prefix[last + 1] - prefix[first]
                budget = min(estimate - 1, budget - (real - limit))
            chunks.append((start, end))
            first = last + 1
        return chunks

    # -- overlap ---------------------------------------------------------------------------------

    def _add_overlap(self, text: str, cores: list[TextSpan]) -> list[TextSpan]:
        """Extend each chunk after the first back into its predecessor by about ``overlap_tokens``."""
        cfg = self.config
        spans = [cores[0]]
        for prev, core in zip(cores, cores[1:], strict=False):
            # Never reach back to the previous chunk's own start: it would become a prefix of this one.
            starts = _word_starts(text, prev.start, core.start)[1:]
            want = cfg.overlap_tokens
            while True:
                start = self._overlap_start(text, starts, core.start, want)
                real = self._count(text[start : core.end]) if start < core.start else 0
                if start == core.start or real <= cfg.max_tokens:
                    break
                want -= max(1, real - cfg.max_tokens)
            spans.append(TextSpan(start, core.end, text[start : core.end]))
        return spans

    def _overlap_start(self, text: str, starts: list[int], end: int, want: int) -> int:
        """The earliest word start in ``starts`` whose text up to ``end`` has at most ``want`` tokens."""
        if want <= 0:
            return end
        # Counts grow as the start moves left; bisect for the leftmost start that still fits.
        lo, hi = 0, len(starts)  # answer index in [lo, hi]; hi means "no overlap"
        while lo < hi:
            mid = (lo + hi) // 2
            if self._count(text[starts[mid] : end]) <= want:
                hi = mid
            else:
                lo = mid + 1
        return starts[lo] if lo < len(starts) else end


def _cut_points(text: str, start: int, end: int, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """Split ``text[start:end]`` right after each separator match; whitespace-only bits join a neighbour."""
    cuts = [m.end() for m in pattern.finditer(text, start, end) if m.end() < end]
    bounds: list[tuple[int, int]] = []
    prev = start
    for cut in [*cuts, end]:
        if bounds and not text[prev:cut].strip():
            bounds[-1] = (bounds[-1][0], cut)  # a whitespace-only bit extends the previous piece
        elif bounds and not text[bounds[-1][0] : bounds[-1][1]].strip():
            bounds[-1] = (bounds[-1][0], cut)  # leading whitespace joins the first real piece
        else:
            bounds.append((prev, cut))
        prev = cut
    return bounds


def _choose_end(pieces: list[_Piece], prefix: list[int], first: int, budget: int, min_tokens: int) -> int:
    """Index of the last piece of the chunk starting at ``first``.

    Takes as many pieces as fit in ``budget`` (at least one), then ends the chunk at the strongest
    boundary among those that keep it at ``min_tokens`` or more, latest first on ties.
    """
    # Greedy reach: the largest ``last`` with prefix[last + 1] - prefix[first] <= budget.
    reach = bisect.bisect_right(prefix, prefix[first] + budget, lo=first + 1) - 2
    reach = max(first, reach)
    if reach == len(pieces) - 1:
        return reach
    best = reach
    for last in range(reach - 1, first - 1, -1):
        if prefix[last + 1] - prefix[first] < min_tokens:
            break
        if pieces[last].boundary > pieces[best].boundary:
            best = last
    return best


def _word_starts(text: str, start: int, end: int) -> list[int]:
    """Offsets in ``[start, end)`` where a word begins (``start`` itself included)."""
    return [start, *(m.end() for m in _WORD_SEP.finditer(text, start, end) if m.end() < end)]
