"""The prefill path: a prompt's ids -> fused (or full) prefill, whole or in pieces, with its stats.

``RagKV`` (ragkv/engine.py) holds the parts (model, retriever, measured speeds, model lock) and
hands them to one ``AnswerPath``; every answer's prefill goes through it (``RagKV.prefill_steps``,
which the answer driver, ``ragkv.driver``, runs a piece at a time between its decode steps). A
prompt is cut into a prefix (before the first chunk), middle segments (chunks, and plain text
between them) and a suffix (the question): :class:`PromptParts`.

Threads: every forward pass runs under the engine's model lock (one piece at a time when a
prefill runs in pieces); loading runs outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragkv.fusion import FusionConfig, FusionInput, PieceBudget, Pieces, drain, fuse_steps
from ragkv.gpu.feed import DeviceSink
from ragkv.gpu.tier import release
from ragkv.model.threads import adapt_threads
from ragkv.planner.session import LoadEstimates, LoadPlanning
from ragkv.types import CachedText, Chunk, ChunkKV, GenerationResult, GenerationStats

if TYPE_CHECKING:
    from ragkv.config import EngineConfig
    from ragkv.model import ModelAdapter
    from ragkv.model.attention import DecodeWeights
    from ragkv.model.batch import Rider
    from ragkv.retriever.kv_retriever import KVRetriever
    from ragkv.retriever.loader import LoadedChunk

__all__ = ["AnswerPath", "AnswerStream", "Prefilled", "PromptParts", "Riders"]

logger = logging.getLogger(__name__)

PREFIX_LRU = 8  # framework prompt prefixes kept (their templates repeat one on every call)
Riders = Callable[[], "Rider | None"]  # asked before each prefill piece: the decode step that may ride on it


class EngineParts(Protocol):
    """What the answer path reads from its engine (``RagKV`` is one); read at each call, so a
    caller that swaps one (a bench swapping the decoder or the load config) is heard."""

    config: EngineConfig
    adapter: ModelAdapter
    decode_weights: DecodeWeights
    retriever: KVRetriever
    load_estimates: LoadEstimates

    @property
    def model_lock(self) -> threading.RLock: ...

    def save_rates_soon(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PromptParts:
    """A prompt's token ids cut where caches apply: prefix | middle segments | suffix."""

    prefix: list[int]  # before the first chunk (the shared system prefix, or a framework's template)
    middle: list[tuple[list[int], bool]]  # (ids, cached?): chunks, and plain text between them
    suffix: list[int]  # after the last chunk (the question): always computed

    @property
    def ids(self) -> list[int]:
        return self.prefix + [t for seg, _ in self.middle for t in seg] + self.suffix

    @property
    def cached_tokens(self) -> int:
        return sum(len(seg) for seg, cached in self.middle if cached)


@dataclass(slots=True)
class Prefilled:
    """A prompt prefilled and ready to decode (see :meth:`RagKV.prefill`)."""

    cache: Any  # the prompt's transformers Cache, its first ``num_tokens`` slots filled
    logits: torch.Tensor  # [vocab] fp32 logits of the prompt's last position
    num_tokens: int  # prompt length (the first answer token goes at this position)
    stats: GenerationStats  # what the prefill reused, recomputed and loaded


class AnswerPath:
    """Prefill (fused or full, whole or in pieces) and decode for one engine's prompts."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        self._prefix_lock = threading.Lock()  # the LRU of framework prompt prefixes

    # ---- prompts ------------------------------------------------------------------------------
    def rag_prompt(self, chunk_texts: Sequence[str], question: str) -> PromptParts:
        """ragkv's own layout: the shared prefix, each chunk (tokenized on its own), the question."""
        r = self.parts.retriever
        middle = [(list(r.chunk_token_ids(t)), True) for t in chunk_texts]
        return PromptParts(r.prefix_ids, middle, self.parts.adapter.encode(r.layout.suffix_text(question)))

    def segments_prompt(self, segments: Sequence[str | CachedText]) -> PromptParts:
        """A whole prompt as segments: plain strings are computed, ``CachedText`` segments reuse their cache.

        Each run of plain text is tokenized as one string, each ``CachedText`` on its own.
        """
        encode = self.parts.adapter.encode
        segs = [s for s in segments if (s.text if isinstance(s, CachedText) else s)]
        cached_at = [i for i, s in enumerate(segs) if isinstance(s, CachedText)]

        def plain(parts: Sequence[str | CachedText]) -> list[int]:
            return encode("".join(p for p in parts if isinstance(p, str)))

        if not cached_at:
            return PromptParts([], [], plain(segs))
        first, last = cached_at[0], cached_at[-1]
        middle = [
            (encode(s.text if isinstance(s, CachedText) else s), isinstance(s, CachedText))
            for s in segs[first : last + 1]
        ]
        suffix = plain(segs[last + 1 :])
        if not suffix:
            raise ValueError("the prompt ends with a cached chunk; it needs some text after the last chunk")
        return PromptParts(plain(segs[:first]) if first else [], middle, suffix)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill_steps(
        self,
        prompt: PromptParts,
        *,
        mode: str = "reuse",
        max_new_tokens: int = 0,
        fusion: FusionConfig | None = None,
        step_tokens: int | PieceBudget | None = None,
        started: float | None = None,
        riders: Riders | None = None,
    ) -> Pieces[Prefilled]:
        """The prompt's cache and last logits, in pieces of about ``step_tokens`` tokens of work.

        Each ``next()`` runs one piece under the model lock; the return value is the
        :class:`Prefilled`. ``mode="full"`` prefills from scratch, ``step_tokens`` prompt tokens a
        piece; ``"reuse"`` loads the chunk caches (first piece) and fuses them, pausing the
        recompute pass between layers (``ragkv.fusion.fuse_steps``). ``None``: one piece; a
        :class:`~ragkv.fusion.PieceBudget` sizes each piece as it comes (the driver's, by time).
        ``started``: when the answer began (the load deadline counts from it; default now).
        ``riders``: asked before each piece of a full prefill for a decode step to carry
        (``ragkv.model.batch.Rider``; the scheduler's rows), None: none.
        """
        if mode not in ("reuse", "full"):
            raise ValueError(f"mode must be 'reuse' or 'full', got {mode!r}")
        budget = PieceBudget.of(step_tokens)
        fusion = fusion or self.parts.config.fusion
        t0 = time.perf_counter() if started is None else started
        ids = prompt.ids
        self.parts.adapter.check_context(len(ids) + max_new_tokens)
        stats = self._new_stats(len(ids), "full" if mode == "full" else fusion.method)
        adapt_threads()  # another process may have taken a core since the last answer
        if mode == "full":
            stats.prefilled_chunk_tokens = prompt.cached_tokens
            pieces = self._full_steps(ids, budget, riders)
        else:
            pieces = self._fused_steps(prompt, fusion, stats, t0, budget)
        cache, logits = yield from self._locked(pieces, stats)
        stats.extra["prefill_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        return Prefilled(cache, logits[-1], len(ids), stats)

    def prefill(self, prompt: PromptParts, **kwargs: Any) -> Prefilled:
        """:meth:`prefill_steps` run to the end now."""
        return drain(self.prefill_steps(prompt, **kwargs))

    def fused_prefill(
        self, prompt: PromptParts, fusion: FusionConfig, stats: GenerationStats, started: float
    ) -> tuple[Any, torch.Tensor]:
        """The fused prefill alone, now (the caller holds what it needs): the cache and the suffix's
        logits ``[suffix, vocab]`` (a bench compares them with full prefill's at every suffix position)."""
        return drain(self._fused_steps(prompt, fusion, stats, started))  # type: ignore[no-any-return]

    def _full_steps(
        self, ids: list[int], budget: PieceBudget | None, riders: Riders | None
    ) -> Pieces[tuple[Any, torch.Tensor]]:
        """A prefill from scratch, ``budget``'s size a piece; the last piece's last position gives the logits.

        Each piece's forward pass carries the decode step ``riders()`` offers it, if any. A piece's
        budget counts the rows riding (Sarathi-Serve's token budget; one per row the step runs,
        ``DecodeBatch.step_rows``): with B rows riding, it runs the budget's size less B prompt
        tokens (at least half the budget), so the pass keeps the size the budget names (on a
        CPU a matmul one row past a multiple of its blocking costs visibly more). Its own compute
        time (pauses excluded) feeds the engine's prefill speed estimate, unless rows rode on it;
        each piece's, riders included, goes to ``budget``.
        """
        a = self.parts.adapter
        cache = a.build_cache([])
        n = max(1, len(ids))
        busy, start, carried = 0.0, 0, False
        while True:
            rider = riders() if riders is not None else None
            rider = rider if rider is not None and rider.logits is None else None  # each step is carried once
            rows = rider.batch.step_rows if rider is not None else 0
            carried = carried or rows > 0
            step = budget.tokens() if budget is not None else None
            # the rows riding take their share of the budget, never more than half of it
            size = max(step - rows, (step + 1) // 2) if step else n
            if start + size >= n:
                break
            began = time.perf_counter()
            a.forward(ids[start : start + size], cache, start, logits="none", rider=rider)  # K/V only: no LM head
            took = time.perf_counter() - began
            busy += took
            if budget is not None:
                budget.spent(size + rows, took)
            start += size
            yield
        began = time.perf_counter()
        logits = a.forward(ids[start:], cache, start, logits="last", rider=rider)
        if budget is not None:
            budget.spent(n - start + rows, time.perf_counter() - began)  # the rows of the last piece's rider
        if not carried:  # a pass that carried decode rows timed their work too: not this prefill's speed
            self.parts.load_estimates.recompute.observe(len(ids), busy + time.perf_counter() - began)
            self.parts.save_rates_soon()
        return cache, logits

    def _fused_steps(
        self,
        prompt: PromptParts,
        fusion: FusionConfig,
        stats: GenerationStats,
        started: float,
        budget: PieceBudget | None = None,
    ) -> Pieces[tuple[Any, torch.Tensor]]:
        """Load the chunk caches (a piece of its own), then fuse them; the recompute pass pauses between layers."""
        p, a = self.parts, self.parts.adapter
        middle, suffix = prompt.middle, prompt.suffix
        prefix_kv = self._prefix_kv(prompt.prefix)
        loaded: list[ChunkKV] = []
        forced: list[bool] = []
        sinks: list[DeviceSink | None] = []  # device-tier entries filled as their chunks land (ragkv.gpu)
        hit_tokens = 0
        plan = self._load_planning(prompt, fusion, started)
        got_all, load_report = p.retriever.loader.load_planned([seg for seg, cached in middle if cached], plan)
        fetched = iter(got_all)
        got: LoadedChunk | None = None
        for seg, cached in middle:
            if not cached:  # plain text between chunks: computed in place by fusion
                loaded.append(a.empty_kv(len(seg)))
                forced.append(True)
                sinks.append(None)
                continue
            got = next(fetched)
            loaded.append(got.kv)
            forced.append(got.recompute)
            sinks.append(got.sink)
            # planned as text (or its tier failed): fusion computes it in place; planned LOCAL: stored,
            # but prefilled here while the other chunks were read
            if got.recompute or got.local:
                stats.prefilled_chunk_tokens += len(seg)
            elif got.hit:
                stats.cache_hits += 1
                if got.device:  # shown only where a device tier serves (stats' keys stay as they were elsewhere)
                    stats.extra["device_hits"] = stats.extra.get("device_hits", 0) + 1
                if got.host:  # ... and a host tier
                    stats.extra["host_hits"] = stats.extra.get("host_hits", 0) + 1
                stats.bytes_loaded += got.nbytes
                hit_tokens += len(seg)
            else:
                stats.cache_misses += 1
                stats.prefilled_chunk_tokens += len(seg)
        if load_report is not None:
            stats.extra["load"] = {**load_report, "deadline_ms": p.config.load.slo_ms}
        inp = FusionInput(prefix_kv, loaded, [seg for seg, _ in middle], suffix, forced=forced, sinks=sinks)
        if budget is not None:
            yield  # loading the chunk caches was this piece
        fuse_started = time.perf_counter()
        paused = _Pauses()
        pieces = _fuse_or_retry(
            a.device,
            inp,
            lambda i: paused.through(fuse_steps(a, i, fusion, prefill_suffix=True, step_tokens=budget, logits="last")),
        )
        # the sinks live in the pass alone from here: a retry out of memory drops them, and their memory
        del inp, got_all, fetched, sinks
        got = None
        fused, retried = yield from pieces
        computed = fused.recomputed_tokens + fused.forced_tokens + len(suffix)
        total = sum(len(seg) for seg, _ in middle) + len(suffix)
        if not retried:  # a pass run twice (out of memory) measures nothing the planner should learn
            # the speed measured is the pass's own: time paused for others' work is not its
            p.load_estimates.observe_prefill(computed, total, time.perf_counter() - fuse_started - paused.seconds)
            p.save_rates_soon()
        stats.recomputed_tokens = fused.recomputed_tokens
        stats.reused_tokens = max(0, hit_tokens - fused.recomputed_tokens)
        if fused.wanted_share is not None:  # an adaptive share: what its target wanted, and whether the cap held
            stats.extra["recompute_wanted"] = round(fused.wanted_share, 4)
            stats.extra["recompute_capped"] = fused.selection_capped
        logits = fused.suffix_logits
        if logits is None:  # empty suffix
            logits = a.forward(suffix, fused.cache, fused.num_tokens, logits="last")
        return fused.cache, logits

    def _locked(self, pieces: Pieces[Any], stats: GenerationStats) -> Pieces[Any]:
        """``pieces``, each run under the model lock and inference mode (released between pieces)."""
        count = 0
        while True:
            count += 1
            with torch.inference_mode(), self.parts.model_lock:
                try:
                    next(pieces)
                except StopIteration as done:
                    stats.extra["prefill_pieces"] = count
                    return done.value
            yield

    def _load_planning(self, prompt: PromptParts, fusion: FusionConfig, started: float) -> LoadPlanning:
        """This answer's load plan inputs: the deadline, and the fusion pass's share of it."""
        cfg = self.parts.config.load
        deadline = None if cfg.slo_ms is None else started + cfg.slo_ms / 1000
        plain = sum(len(seg) for seg, c in prompt.middle if not c)
        est = self.parts.load_estimates
        work = fusion.ratio * prompt.cached_tokens + plain + len(prompt.suffix)
        reserve = est.fusion_fixed.value + est.recompute.seconds(work)
        return LoadPlanning(cfg, est, deadline, reserve, fusion_ratio=fusion.ratio)

    def _prefix_kv(self, prefix: list[int]) -> ChunkKV:
        """Exact KV of a prompt's text before its first chunk; the last few are kept (framework
        templates repeat theirs on every call)."""
        r, a = self.parts.retriever, self.parts.adapter
        if prefix == r.prefix_ids:
            return r.computer.prefix_kv()
        if not prefix:
            return a.empty_kv()
        key = tuple(prefix)
        with self._prefix_lock:
            kv = self._prefixes.get(key)
            if kv is not None:
                self._prefixes.move_to_end(key)
                return kv
        kv = a.prefill_kv(prefix)  # outside the LRU lock: a racing thread computes the same KV
        with self._prefix_lock:
            self._prefixes[key] = kv
            while len(self._prefixes) > PREFIX_LRU:
                self._prefixes.popitem(last=False)
        return kv

    def _new_stats(self, prompt_tokens: int, fusion: str) -> GenerationStats:
        """Stats of one answer, naming the dtype it is computed in (figures from bf16 and fp32 differ ~2x)."""
        from ragkv.model.placement import dtype_name

        a = self.parts.adapter
        return GenerationStats(
            prompt_tokens=prompt_tokens,
            fusion=fusion,
            dtype=dtype_name(a.dtype),
            dtype_reason=a.dtype_reason,
            decode_weights=self.parts.decode_weights,
        )


class AnswerStream:
    """Iterates text deltas of an answer; after exhaustion ``.result`` is the ``GenerationResult``."""

    def __init__(
        self,
        inner: Iterator[tuple[str, GenerationStats | None]],
        sources: tuple[Chunk, ...],
        retrieval_ms: float,
        warning: str | None = None,
    ) -> None:
        self._inner, self.sources, self.retrieval_ms = inner, sources, retrieval_ms
        self.warning = warning  # set when the answer had no sources to draw on (an empty index)
        self._parts: list[str] = []
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for delta, stats in self._inner:
            if stats is not None:
                stats.extra["retrieval_ms"] = round(self.retrieval_ms, 2)
                if self.warning:
                    stats.extra["warning"] = self.warning
                self._result = GenerationResult("".join(self._parts).strip(), stats, sources=self.sources)
            elif delta:
                self._parts.append(delta)
                yield delta

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("iterate the stream to the end before reading .result")
        return self._result


def _fuse_or_retry(
    device: torch.device, inp: FusionInput, run: Callable[[FusionInput], Pieces[Any]]
) -> Pieces[tuple[Any, bool]]:
    """``(run(inp)'s result, whether it was retried)``: out of device memory anywhere in the pass, it
    runs once more without this request's device-tier admissions (``inp.sinks``) and with the
    device tier emptied (``ragkv.gpu.release``). The caller keeps no reference to ``inp``.

    The retry starts only once the failed pass is gone (outside the handler: the exception's
    traceback holds its buffers; the pass stops its staging thread as it fails). A second failure
    goes to the caller. The chunks themselves stay where they were loaded, so a device-tier hit is
    still used; the pass is the same, only its memory differs.
    """
    try:
        return (yield from run(inp)), False
    except torch.OutOfMemoryError as e:
        why = str(e)  # not the exception: a handler keeping the log record would keep its buffers
    logger.warning("out of device memory in a fused prefill (%s); emptying the device tier and retrying once", why)
    inp = replace(inp, sinks=())
    release(device)
    return (yield from run(inp)), True


class _Pauses:
    """Seconds a pass run in pieces spent paused between them (others' work ran then)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def through(self, pieces: Pieces[Any]) -> Pieces[Any]:
        """``pieces`` passed on, timing each pause."""
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            paused = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - paused
