"""Finding registered chunk texts in a prompt, and cutting the prompt into segments around them.

Shared by the framework integrations and ``ragkv serve`` (prompts that clients send), so it lives
below both.

Frameworks build prompts by string formatting: retrieved texts are stripped, joined with blank
lines and pasted into a template. The engine takes the finished prompt as segments, plain text
to prefill and ``CachedText`` to load from the chunk store. This module is the step between:
given the texts a framework was handed (the registry) and the prompt it produced, it claims every
span of the prompt that is exactly one of those texts, or a tolerated variant of one:

1. the text as registered;
2. the text stripped of surrounding whitespace (every LlamaIndex synthesizer strips chunks);
3. the text as Python prints it inside a list (``repr`` without its quotes): llama-index-core
   0.14's ``simple_summarize`` formats the chunk *list* into its prompt, so the prompt holds
   ``['first chunk', 'second\\nchunk']`` with escaped newlines and quotes;
4. one paragraph of the text, when the framework split the text apart (pieces shorter than
   ``min_chars`` are left alone: too likely to occur by chance, too short to pay off).

Each form is also tried with the blank-line separator appended, because that is how ragkv lays a
chunk out at index time (``PromptLayout.chunk_end``) and how both frameworks join documents: a
chunk from ragkv's own index followed by a separator in the prompt is then found in the form
whose cache was precomputed.

A segment is only ever a verbatim slice of the prompt, so a match is never wrong; text that is
not found in any form stays plain and is prefilled, exactly as a plain model would.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.types import CachedText

REGISTRY_SYNC_S = 2.0  # how often a prompt may trigger a look at the catalog for newly indexed chunks

__all__ = ["SEPARATOR", "ChunkRegistry", "MatchConfig", "Segment", "TenantChunks", "chunk_forms", "split_prompt"]

SEPARATOR = "\n\n"  # ragkv's chunk_end, LangChain's document_separator, LlamaIndex's repack join

Segment = str | CachedText

# Match priority: lower claims first; within a priority, longer forms claim first.
_EXACT, _STRIPPED, _LISTED, _PIECE = 0, 1, 2, 3  # a whole text, even escaped, beats a paragraph
_ANCHOR = 16  # characters of a form looked up in the prompt's window set before a full find()
_ANCHOR_ABOVE = 64  # below this many forms, plain find() is cheaper than building the window set


@dataclass(frozen=True, slots=True)
class MatchConfig:
    """How tolerant chunk finding is."""

    min_chars: int = 32  # forms shorter than this (separator excluded) are never matched
    pieces: bool = True  # also match single paragraphs of a registered text

    def __post_init__(self) -> None:
        if self.min_chars < 1:
            raise ValueError("min_chars must be >= 1; it guards against matching short texts by chance")


def chunk_forms(text: str, config: MatchConfig = MatchConfig()) -> list[tuple[int, str]]:
    """The ``(priority, form)`` pairs a registered ``text`` may appear as in a prompt.

    >>> for priority, form in chunk_forms(" Some text. ", MatchConfig(min_chars=5)):
    ...     print(priority, repr(form))
    0 ' Some text. \\n\\n'
    0 ' Some text. '
    1 'Some text.\\n\\n'
    1 'Some text.'

    """
    out: list[tuple[int, str]] = []
    seen: set[str] = set()

    def add(priority: int, form: str) -> None:
        if len(form.strip()) < config.min_chars:
            return
        for f in (form + SEPARATOR, form):
            if f not in seen:
                seen.add(f)
                out.append((priority, f))

    add(_EXACT, text)
    stripped = text.strip()
    add(_STRIPPED, stripped)
    for t in (text, stripped):
        listed = repr(t)[1:-1]
        if listed != t:
            add(_LISTED, listed)
    if config.pieces:
        paragraphs = [p.strip() for p in stripped.split(SEPARATOR)]
        if len(paragraphs) > 1:
            for p in paragraphs:
                add(_PIECE, p)
    return out


def _claim_order(forms: Iterable[tuple[int, str]]) -> list[str]:
    """Forms in claiming order: by priority, then longest first (ties broken by text, for determinism)."""
    best: dict[str, int] = {}
    for priority, form in forms:
        best[form] = min(priority, best.get(form, priority))
    return [f for f, _ in sorted(best.items(), key=lambda kv: (kv[1], -len(kv[0]), kv[0]))]


def _find_spans(prompt: str, ordered_forms: Sequence[str]) -> list[tuple[int, int]]:
    """Greedy non-overlapping occurrences of ``ordered_forms`` in ``prompt``, sorted by start."""
    starts: list[int] = []
    ends: list[int] = []
    windows: set[str] | None = None
    if len(ordered_forms) > _ANCHOR_ABOVE:
        windows = {prompt[i : i + _ANCHOR] for i in range(max(0, len(prompt) - _ANCHOR + 1))}
    for form in ordered_forms:
        if windows is not None and len(form) >= _ANCHOR and form[:_ANCHOR] not in windows:
            continue
        pos = prompt.find(form)
        while pos >= 0:
            end = pos + len(form)
            i = bisect_right(starts, pos)
            free = (i == 0 or ends[i - 1] <= pos) and (i == len(starts) or starts[i] >= end)
            if free:
                starts.insert(i, pos)
                ends.insert(i, end)
            pos = prompt.find(form, end if free else pos + 1)
    return list(zip(starts, ends, strict=True))


def split_prompt(
    prompt: str, texts: Iterable[str], *, config: MatchConfig = MatchConfig(), require_suffix: bool = True
) -> list[Segment]:
    """Cut ``prompt`` into plain and cached segments around the registered ``texts`` it contains.

    The segments always concatenate back to ``prompt``. With ``require_suffix`` a match that ends
    the prompt stays plain (the engine needs some text after the last cached chunk).

    >>> chunk = "Apples grow on trees in orchards."
    >>> split_prompt("Context:\\n" + chunk + "\\n\\nQ: where?", [chunk], config=MatchConfig(min_chars=8))
    ['Context:\\n', CachedText(text='Apples grow on trees in orchards.\\n\\n'), 'Q: where?']
    >>> split_prompt("nothing known here", [chunk])
    ['nothing known here']
    """
    forms = _claim_order(f for t in texts for f in chunk_forms(t, config))
    return _assemble(prompt, _find_spans(prompt, forms) if forms else [], require_suffix)


class ChunkRegistry:
    """The chunk texts a framework was handed, most recently registered last; thread-safe.

    Bounded (least recently registered texts are forgotten first) so a long-running process does
    not scan an ever-growing list for every prompt.

    Args:
        capacity: how many texts to remember.
        config: how tolerant matching is.
    """

    def __init__(self, capacity: int = 4096, config: MatchConfig = MatchConfig()) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity, self.config = capacity, config
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._pinned: set[str] = set()  # texts kept regardless of capacity (the engine's own index)
        self._lock = threading.Lock()
        self._ordered: list[str] | None = None  # claiming order of all forms, rebuilt after a change
        self._anchors: dict[str, list[int]] = {}  # form[:_ANCHOR] -> indices into _ordered
        self._short: list[int] = []  # forms shorter than an anchor: always tried

    def add(self, texts: Iterable[str], *, pinned: bool = False) -> None:
        """Register ``texts`` (re-registering one makes it the most recent).

        ``pinned`` texts (chunks of the engine's own index) do not count against ``capacity``.
        """
        if isinstance(texts, str):
            raise TypeError("ChunkRegistry.add takes a list of texts; wrap a single text in a list")
        with self._lock:
            for t in texts:
                if not isinstance(t, str):
                    raise TypeError(f"chunk texts must be str, got {type(t).__name__}")
                if pinned:
                    self._pinned.add(t)
                    continue
                self._texts[t] = None
                self._texts.move_to_end(t)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
            self._ordered = None

    def unpin_all(self) -> None:
        """Forget every pinned text (before pinning the engine's index again)."""
        with self._lock:
            self._pinned.clear()
            self._ordered = None

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._pinned.clear()
            self._ordered = None

    def __len__(self) -> int:
        return len(self._texts.keys() | self._pinned)

    def __contains__(self, text: object) -> bool:
        return text in self._texts or text in self._pinned

    def split(self, prompt: str, *, require_suffix: bool = True) -> list[Segment]:
        """``split_prompt`` over the registered texts.

        Only forms whose first characters occur in the prompt are searched (an anchor index), so
        the cost grows with the prompt, not with the number of registered texts.
        """
        with self._lock:
            if self._ordered is None:
                self._rebuild()
            ordered, anchors, short = self._ordered or [], self._anchors, self._short
        if not ordered:
            return _assemble(prompt, [], require_suffix)
        hit = set(short)
        for i in range(max(0, len(prompt) - _ANCHOR + 1)):
            found = anchors.get(prompt[i : i + _ANCHOR])
            if found:
                hit.update(found)
        spans = _find_spans(prompt, [ordered[i] for i in sorted(hit)])
        return _assemble(prompt, spans, require_suffix)

    def _rebuild(self) -> None:
        texts = [*self._texts, *(t for t in self._pinned if t not in self._texts)]
        self._ordered = _claim_order(f for t in texts for f in chunk_forms(t, self.config))
        self._anchors, self._short = {}, []
        for i, form in enumerate(self._ordered):
            if len(form) < _ANCHOR:
                self._short.append(i)
            else:
                self._anchors.setdefault(form[:_ANCHOR], []).append(i)


class TenantChunks:
    """A tenant's :class:`ChunkRegistry`, kept in step with its indexed chunks in the catalog.

    Its indexed chunks are pinned (never forgotten while indexed); texts frameworks register
    (``registry.add``) come and go by capacity. The catalog is looked at most every ``sync_s``
    seconds (one row-id query; texts are read only for new rows), or now with ``refresh=True``.

    Args:
        catalog: the catalog (``all_chunk_rows(tenant)``, ``chunks_by_rows(rows, tenant)``).
        tenant: whose chunks.
        sync_s: the shortest time between two looks at the catalog.
    """

    def __init__(self, catalog: Any, tenant: str, sync_s: float = REGISTRY_SYNC_S) -> None:
        self.catalog, self.tenant, self.sync_s = catalog, tenant, sync_s
        self.registry = ChunkRegistry()
        self._lock = threading.Lock()
        self._rows: frozenset[int] = frozenset()  # catalog rows whose texts are pinned
        self._synced = float("-inf")  # perf_counter of the last catalog check

    def current(self, *, refresh: bool = False) -> ChunkRegistry:
        """The registry, after a look at the catalog if ``sync_s`` has passed (or ``refresh``)."""
        with self._lock:
            now = time.perf_counter()
            if refresh or now - self._synced >= self.sync_s:
                self._synced = now
                rows = frozenset(self.catalog.all_chunk_rows(self.tenant))
                if rows != self._rows:
                    if not rows >= self._rows:  # documents were removed or replaced: pin afresh
                        self.registry.unpin_all()
                        self._rows = frozenset()
                    new = sorted(rows - self._rows)
                    self.registry.add([c.text for c in self.catalog.chunks_by_rows(new, self.tenant)], pinned=True)
                    self._rows = rows
        return self.registry


def _assemble(prompt: str, spans: list[tuple[int, int]], require_suffix: bool) -> list[Segment]:
    if require_suffix and spans and spans[-1][1] == len(prompt):
        spans = spans[:-1]
    segments: list[Segment] = []
    cursor = 0
    for start, end in spans:
        if start > cursor:
            segments.append(prompt[cursor:start])
        segments.append(CachedText(prompt[start:end]))
        cursor = end
    if cursor < len(prompt) or not segments:
        segments.append(prompt[cursor:])
    return segments
