"""What the vLLM connector does on ragkv's side, with no vLLM import (so CI tests it without vLLM).

vLLM hands a connector token ids, never text, and its API can only say "the first N prompt tokens
are computed". So chunks are found in the ids themselves: a chunk's store key is
over the ids of its text as laid out and tokenized on its own (``layout.chunk_text``: the stripped
text and a blank line), and a prompt tokenizes the text identically except at its end (SmolLM2's
tokenizer writes the blank line as one token alone, as two before a word). A chunk is therefore
found by its *core* (the ids of the stripped text, a prefix of the stored ids), and fusion takes the
core's slice of the stored cache: the KV of a token depends only on the tokens before it, so the
slice is the cache of exactly the ids the prompt holds. Matching on ids (not on the decoded text
with :mod:`ragkv.matching`) is exact by construction: the ids fused are the ids vLLM sees.

The steps: :class:`ChunkTokenIndex` finds chunk spans; :func:`choose_span` picks how many leading
tokens to report (every chunk up to the first one the store cannot serve, to its last token);
:class:`RagkvSide` checks entries (a missing, damaged or foreign one is a miss), fuses the context
with ragkv's own model copy, and returns the K/V of the reported tokens for vLLM's paged cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ragkv.cache.store import TieredStore
    from ragkv.fusion import FusionConfig
    from ragkv.model import ModelAdapter
    from ragkv.retriever.precompute import ChunkComputer, StoredEntry
    from ragkv.types import ChunkKey, ChunkKV, CodecSpec

logger = logging.getLogger(__name__)

__all__ = ["ChunkSpan", "ChunkTokenIndex", "KnownChunk", "RagkvSide", "ServePlan", "choose_span", "slot_mapping"]

_ANCHOR = 4  # leading ids of a chunk looked up in a dict before comparing the rest


@dataclass(frozen=True, slots=True)
class KnownChunk:
    """One indexed chunk as the connector looks for it."""

    stored_ids: tuple[int, ...]  # the ids its store key is over (text as laid out, tokenized alone)
    core: int  # leading stored ids a prompt holds verbatim (the stripped text's ids)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.stored_ids[: self.core]


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A chunk found in a prompt: prompt ids ``start:end`` are its first ``end - start`` stored ids."""

    start: int
    end: int
    chunk: KnownChunk


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What the connector serves for one request."""

    spans: tuple[ChunkSpan, ...]  # the chunks fused, in prompt order
    context_end: int  # prompt ids 0..context_end are fused (the last chunk's end)
    start: int  # first token written into vLLM's cache (vLLM's own prefix hit, whole blocks)
    end: int  # tokens reported computed: context_end, or one less where the prompt ends there
    transform: str = ""  # digest of the channel transform the keys were made with ("": none)

    @property
    def new_tokens(self) -> int:
        return self.end - self.start


class ChunkTokenIndex:
    """Indexed chunks by their ids; finds them in a prompt's ids (greedy, left to right, longest first).

    Args:
        min_tokens: chunks shorter than this are never matched (too likely by chance, too short to pay).
    """

    def __init__(self, min_tokens: int = 8) -> None:
        if min_tokens < _ANCHOR:
            raise ValueError(f"min_tokens must be >= {_ANCHOR}")
        self.min_tokens = min_tokens
        self._by_anchor: dict[tuple[int, ...], list[tuple[tuple[int, ...], KnownChunk]]] = {}
        self._stored: set[tuple[int, ...]] = set()

    def __len__(self) -> int:
        return len(self._stored)

    def add(self, stored_ids: Sequence[int], core_ids: Sequence[int]) -> None:
        """Index a chunk stored under ``stored_ids`` whose prompt form may be cut to ``core_ids``.

        ``core_ids`` not a prefix of ``stored_ids`` (a tokenizer that merges across the text's end)
        leaves only the whole stored form findable.
        """
        stored = tuple(stored_ids)
        if stored in self._stored or len(stored) < self.min_tokens:
            return
        self._stored.add(stored)
        core = len(core_ids) if stored[: len(core_ids)] == tuple(core_ids) else len(stored)
        chunk = KnownChunk(stored, core)
        forms = {stored} | ({chunk.ids} if core >= self.min_tokens else set())
        for form in forms:
            bucket = self._by_anchor.setdefault(form[:_ANCHOR], [])
            bucket.append((form, chunk))
            bucket.sort(key=lambda fc: -len(fc[0]))

    def find(self, prompt_ids: Sequence[int]) -> list[ChunkSpan]:
        """Non-overlapping chunk spans in ``prompt_ids``, by start.

        >>> index = ChunkTokenIndex(min_tokens=4)
        >>> index.add([5, 6, 7, 8, 9, 99], [5, 6, 7, 8, 9])
        >>> [(s.start, s.end) for s in index.find([1, 5, 6, 7, 8, 9, 2, 2])]
        [(1, 6)]
        """
        ids = tuple(prompt_ids)
        spans: list[ChunkSpan] = []
        i = 0
        while i <= len(ids) - _ANCHOR:
            hit = None
            for form, chunk in self._by_anchor.get(ids[i : i + _ANCHOR], ()):
                if ids[i : i + len(form)] == form:
                    hit = ChunkSpan(i, i + len(form), chunk)
                    break
            if hit is None:
                i += 1
                continue
            spans.append(hit)
            i = hit.end
        return spans


def choose_span(
    spans: Sequence[ChunkSpan],
    prompt_len: int,
    num_computed: int,
    block_size: int,
    servable: Callable[[KnownChunk], bool],
) -> ServePlan | None:
    """The leading tokens ragkv serves: every chunk up to the first unservable one, to its last token.

    The text before and between chunks is fused too (computed exactly by ragkv's model), so the
    span ends at the last servable chunk. It stays below the prompt's length (vLLM computes at least
    one token to sample from) and starts at vLLM's own prefix hit ``num_computed`` (whole blocks).
    vLLM 0.32's scheduler takes a count that ends inside a block (it computes the rest of that
    block), so the last partial block is served too: cut to whole blocks, vLLM would prefill up to
    ``block_size - 1`` more tokens. None: less than a block beyond vLLM's hit to serve (a fusion of
    the whole context would cost more than vLLM computing those tokens).

    >>> chunk = KnownChunk(tuple(range(300)), 300)
    >>> plan = choose_span([ChunkSpan(10, 310, chunk)], 330, 128, 128, lambda c: True)
    >>> (plan.start, plan.end, plan.context_end)
    (128, 310, 310)
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    kept: list[ChunkSpan] = []
    for span in spans:
        if not servable(span.chunk):
            break
        kept.append(span)
    if not kept:
        return None
    context_end = kept[-1].end
    end = min(context_end, prompt_len - 1)
    start = num_computed // block_size * block_size
    if end - start < block_size:
        return None
    return ServePlan(tuple(kept), context_end, start, end)


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """vLLM's slot of each token ``start..end`` of a request whose blocks are ``block_ids``: ``[end - start]`` int64.

    >>> slot_mapping([7, 2], 126, 130, 128).tolist()
    [1022, 1023, 256, 257]
    """
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {end} need {-(-end // block_size)} blocks; the request has {len(block_ids)}")
    tok = torch.arange(start, end)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[tok // block_size] * block_size + tok % block_size


class RagkvSide:
    """ragkv's model copy, store and indexed chunks, as the connector uses them (both vLLM sides).

    Args:
        adapter: ragkv's own copy of the model (the one chunk caches were computed with).
        computer: keys, prefix and store of the chunk caches (tenant, secret and channel transform included;
            the transform is read from the store, never calibrated here).
        codec: the (codec, level) chunks are read at.
        fusion: how chunk caches are fused (selection strategy and ratio).
        texts: a callable returning chunk texts indexed since its last call (called every ``refresh_s``).
        system: the system prompt chunk caches were computed after (``RetrieverConfig.system``).
        refresh_s: how often the chunk texts are re-read.
        decoded_entries: how many decoded chunk caches are kept between the scheduler's check and
            the worker's load (both sides run in one process on CPU).
        record: called with each entry saved back from vLLM's K/V (the catalog's ``record_stored``).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        computer: ChunkComputer,
        codec: CodecSpec,
        fusion: FusionConfig,
        texts: Callable[[], Iterable[str]],
        *,
        system: str | None = None,
        refresh_s: float = 2.0,
        decoded_entries: int = 16,
        record: Callable[[StoredEntry], None] | None = None,
    ) -> None:
        self.adapter, self.computer, self.codec, self.fusion = adapter, computer, codec, fusion
        self.store: TieredStore = computer.store
        self._texts, self._refresh_s, self._system = texts, refresh_s, system
        self._index = ChunkTokenIndex()
        self._known: set[str] = set()
        self._refreshed = float("-inf")
        self._decoded: OrderedDict[str, ChunkKV] = OrderedDict()
        self._max_decoded = decoded_entries
        self._lock = threading.RLock()
        self._said: set[str] = set()
        self._record = record
        self._head: tuple[tuple[int, ...], ChunkKV] | None = None  # the last text-before-the-chunks prefill
        self.phase_s: dict[str, float] = {}  # seconds per step of plan / fused_kv, summed (benchmarks read it)
        self.fused_on: dict[str, object] = {}  # the torch threads and CPUs the last fusion ran with (benchmarks)

    def add_time(self, phase: str, started: float) -> float:
        """Add the seconds since ``started`` to ``phase_s[phase]``; return now."""
        now = time.perf_counter()
        with self._lock:  # the scheduler plans while the loader thread fuses
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + now - started
        return now

    def say_once(self, reason: str) -> None:
        """Log why a request is served without ragkv, once per reason."""
        if reason not in self._said:
            self._said.add(reason)
            logger.warning("ragkv vLLM connector: %s; vLLM computes the request itself", reason)

    # ---- scheduler side -----------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> None:
        """Index chunk texts indexed since the last look (at most every ``refresh_s`` seconds)."""
        now = time.monotonic()
        if not force and now - self._refreshed < self._refresh_s:
            return
        self._refreshed = now
        layout = self.adapter.layout(self._system)
        new = [t for t in self._texts() if t not in self._known]
        with self._lock:
            for text in new:
                self._known.add(text)
                self._index.add(self.adapter.encode(layout.chunk_text(text)), self.adapter.encode(text.strip()))
        transforms = self.computer.transforms
        # keys digest the channel transform (when a stored codec is coded in it): read it again when
        # none is usable yet or new chunks were indexed (an indexer may have calibrated or replaced it)
        if self.computer.uses_transform() and (new or transforms.current() is None) and transforms.reload() is None:
            self.say_once(
                "no usable channel transform in the store for this model and tenant (ragkv's indexing "
                "calibrates it); chunks at the levels coded in it are misses"
            )

    def plan(self, prompt_ids: Sequence[int], num_computed: int, block_size: int) -> ServePlan | None:
        """What to serve for a prompt (None: nothing; vLLM computes it). Never raises for a bad store."""
        started = time.perf_counter()
        try:
            return self._plan(prompt_ids, num_computed, block_size)
        finally:
            self.add_time("plan", started)

    def _plan(self, prompt_ids: Sequence[int], num_computed: int, block_size: int) -> ServePlan | None:
        try:
            self.refresh()
            self.adapter.check_context(len(prompt_ids))
        except Exception as e:  # catalog down, prompt longer than ragkv's model takes: not ours to serve
            self.say_once(f"no chunk lookup ({type(e).__name__}: {e})")
            return None
        with self._lock:
            spans = self._index.find(prompt_ids)
        plan = choose_span(spans, len(prompt_ids), num_computed, block_size, lambda c: self.load(c) is not None)
        if plan is None or not self.computer.uses_transform():
            return plan
        return replace(plan, transform=self.computer.transforms.digest())

    def saveable(self, prompt_ids: Sequence[int]) -> ChunkSpan | None:
        """The chunk of this prompt vLLM will compute and ragkv can store from vLLM's K/V (None: none).

        Only the prompt's first chunk qualifies, and only when the text before it is ragkv's shared
        prefix: its K/V in vLLM's cache are then what ragkv's indexing computes, up to how the
        prefix's closing blank line was tokenized (SmolLM2 writes it as one token alone, as two
        before a word: the chunk then sits one position later, which :meth:`save_chunk` rotates
        back). A later chunk's K/V hold attention to the chunks before it in this prompt (every
        layer past the first), which no rotation undoes: stored as the chunk's context-free cache,
        they would tie later fused answers to the context the chunk was first seen in. Such chunks
        are left to ragkv's indexing.
        """
        with self._lock:
            spans = self._index.find(prompt_ids)
        if not spans or not self._after_prefix(prompt_ids, spans[0].start) or self.load(spans[0].chunk) is not None:
            return None
        if not self._can_code(self.key(spans[0].chunk)):
            return None  # ragkv's indexing calibrates the transform; until then such chunks are not stored
        return spans[0]

    def _can_code(self, key: ChunkKey) -> bool:
        """Whether ``key``'s entry can be written here: plain, or coded in a transform this process holds."""
        return not key.transform_digest or self.computer.transforms.find(key.transform_digest) is not None

    def _after_prefix(self, prompt_ids: Sequence[int], start: int) -> bool:
        """Whether prompt ids ``0..start`` are ragkv's shared prefix, as ids or as text (special tokens kept)."""
        prefix = self.computer.prefix_ids
        if tuple(prompt_ids[:start]) == prefix:
            return True
        if abs(start - len(prefix)) > 4:  # a separator tokenized differently, not another text
            return False
        text = self.adapter.decode(prompt_ids[:start], skip_special_tokens=False)
        return text == self.adapter.decode(prefix, skip_special_tokens=False)

    # ---- both sides ---------------------------------------------------------------------------
    def key(self, chunk: KnownChunk) -> ChunkKey:
        return self.computer.chunk_key(chunk.stored_ids, self.codec)

    def load(self, chunk: KnownChunk) -> ChunkKV | None:
        """The chunk's stored cache, checked against its key and the model; None when missing or unusable.

        A key at a codec coded in the channel transform digests the transform held here: with none
        (missing, damaged or foreign in the store) it is a key no entry has, so a miss.
        """
        from ragkv import codec
        from ragkv.errors import CodecError
        from ragkv.retriever.loader import expected_blob

        key = self.key(chunk)
        with self._lock:
            kv = self._decoded.get(key.storage_key)
            if kv is not None:
                self._decoded.move_to_end(key.storage_key)
                return kv
        try:
            blob = self.store.get(key.storage_key)
        except Exception as e:  # a tier that is down: a miss, never a failed request
            self.say_once(f"store unreadable ({type(e).__name__}: {e})")
            return None
        if blob is None:
            return None
        expect = expected_blob(key, self.adapter.spec, len(chunk.stored_ids), self.computer.store_secret)
        # the key digests the transform the chunk was coded in: the one it names is the one held here
        transform = self.computer.transforms.find(key.transform_digest) if key.transform_digest else None
        try:
            kv = codec.decode(
                blob, expect=expect, device=self.adapter.device, dtype=self.adapter.dtype, transform=transform
            )
        except CodecError as e:  # damaged, made for another key, model or tenant, or coded in another transform
            self.say_once(f"unusable cache entry ({e})")
            return None
        with self._lock:
            self._decoded[key.storage_key] = kv
            while len(self._decoded) > self._max_decoded:
                self._decoded.popitem(last=False)
        return kv

    # ---- worker side --------------------------------------------------------------------------
    @torch.no_grad()
    def fused_kv(self, prompt_ids: Sequence[int], plan: ServePlan) -> ChunkKV:
        """The fused K/V of prompt tokens ``plan.start..plan.end``: ``[layers, kv_heads, tokens, head_dim]``.

        The text before the first chunk is prefilled exactly, the text between chunks is computed
        in place (fusion's forced tokens), each chunk's stored cache is re-rotated to its offset,
        and the tokens the fusion strategy selects are recomputed. A chunk whose entry vanished
        since the scheduler checked it is computed in place too (exact, only slower).
        """
        from ragkv.fusion import FusionInput, fuse

        ids = list(prompt_ids)
        first = plan.spans[0].start
        if plan.transform and self.computer.transforms.digest() != plan.transform:
            # a worker in another process than the scheduler: read the transform the scheduler keyed with
            self.computer.transforms.reload()
        affinity = getattr(os, "sched_getaffinity", None)  # Linux only
        self.fused_on = {"torch_threads": torch.get_num_threads(), "cpus": sorted(affinity(0)) if affinity else None}
        started = time.perf_counter()
        prefix = self._head_kv(ids[:first])
        started = self.add_time("prefix", started)
        parts: list[ChunkKV] = []
        part_ids: list[list[int]] = []
        forced: list[bool] = []
        cursor = first
        for span in plan.spans:
            if span.start > cursor:  # plain text between chunks
                parts.append(self.adapter.empty_kv(span.start - cursor))
                part_ids.append(ids[cursor : span.start])
                forced.append(True)
            kv = self.load(span.chunk)
            n = span.end - span.start
            if kv is None:
                self.say_once("a chunk entry vanished between scheduling and loading; computing it in place")
            parts.append(kv.slice(0, n) if kv is not None else self.adapter.empty_kv(n))
            part_ids.append(ids[span.start : span.end])
            forced.append(kv is None)
            cursor = span.end
        started = self.add_time("entries", started)
        inp = FusionInput(prefix, parts, part_ids, ids[plan.context_end :], forced=forced)
        fused = fuse(self.adapter, inp, self.fusion)
        started = self.add_time("fusion", started)
        out = self.adapter.cache_to_kv(fused.cache, plan.start, plan.end, self.adapter.fingerprint)
        self.add_time("extract", started)
        return out

    def _head_kv(self, ids: list[int]) -> ChunkKV:
        """The exact K/V of the text before the first chunk, reused while it repeats (a RAG template's
        system prompt and header are the same in every request)."""
        if not ids:
            return self.adapter.empty_kv()
        with self._lock:
            head = self._head
        if head is not None and head[0] == tuple(ids):
            return head[1]
        kv = self.adapter.prefill_kv(ids)
        with self._lock:
            self._head = (tuple(ids), kv)
        return kv

    @torch.no_grad()
    def save_chunk(
        self, prompt_ids: Sequence[int], span: ChunkSpan, keys: torch.Tensor, values: torch.Tensor
    ) -> list[StoredEntry]:
        """Store chunk ``span`` from the K/V vLLM computed for it, as ragkv's indexing would.

        ``keys``/``values`` ``[layers, kv_heads, span tokens, head_dim]`` are the prompt's tokens
        ``span.start..span.end``, post-RoPE at those positions; ragkv stores a chunk right after
        its prefix ids, so keys rotated elsewhere (the prefix's blank line tokenized differently,
        see :meth:`saveable`) are rotated back with the model's own rotary. Stored ids the prompt
        wrote differently (the chunk's closing blank line, see the module docstring) are computed
        after them with ragkv's model. The entry is encoded, bound to its key and signed as
        indexing does, at the primary codec and at every other stored codec no tier holds yet,
        and recorded.
        """
        from ragkv.types import ChunkKV

        chunk, n, a = span.chunk, span.end - span.start, self.adapter
        if not self._after_prefix(prompt_ids, span.start):
            raise ValueError("only a chunk right after ragkv's shared prefix is saved (see RagkvSide.saveable)")
        if tuple(prompt_ids[span.start : span.end]) != chunk.stored_ids[:n] or keys.shape[2] != n:
            raise ValueError(f"the K/V given are not the prompt's tokens {span.start}..{span.end} of the chunk")
        pos = torch.arange(span.start, span.end)
        kv = ChunkKV(keys.to(a.device, a.dtype), values.to(a.device, a.dtype), pos, a.fingerprint)
        stored_at = len(self.computer.prefix_ids)
        if span.start != stored_at:
            kv = a.rerotate(kv, stored_at)
        tail = list(chunk.stored_ids[n:])
        if tail:  # a token's K/V depend only on the tokens before it: prefix, then the chunk's first n
            rest = a.prefill_kv(tail, past=[self.computer.prefix_kv(), kv])
            kv = ChunkKV(
                torch.cat([kv.keys, rest.keys], dim=2),
                torch.cat([kv.values, rest.values], dim=2),
                torch.cat([kv.positions, rest.positions.to(kv.positions.device)]),
                a.fingerprint,
            )
        written = []
        for spec in self.computer.codecs:
            key = self.computer.chunk_key(chunk.stored_ids, spec)
            if not self._can_code(key):
                continue  # coded in a transform the store holds none of: no reader would look it up
            if spec != self.codec and self.store.contains(key.storage_key):
                continue  # the primary was missing or unusable; other levels stored already are kept
            entry = self.computer.put(kv, key)
            if entry is not None:
                written.append(entry)
                if self._record is not None:
                    self._record(entry)
        return written

    @torch.no_grad()
    def exact_kv(self, prompt_ids: Sequence[int], plan: ServePlan) -> ChunkKV:
        """The K/V of prompt tokens ``plan.start..plan.end`` by a plain prefill (the fallback when fusion fails)."""
        return self.adapter.prefill_kv(list(prompt_ids)[: plan.end]).slice(plan.start, plan.end)
