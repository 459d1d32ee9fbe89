"""Fusion: turn a cached prefix and independently computed chunk caches into one prompt cache.

Chunk caches computed on their own lack attention to the chunks before them. Fusion re-rotates
each chunk to its offset, then recomputes a selected subset of chunk tokens layer by layer
through the model's own decoder layers (their queries see the whole fused cache with the exact
causal mask, their fresh K/V replace the cached entries), as CacheBlend does, with selection
strategies from a registry (see ``ragkv.selection``).

The steps, each a function: :func:`_place` (re-rotate chunks into one buffer),
:func:`_question_attention` (the question probe, for query-aware strategies), :func:`_recompute`
(the layer loop, narrowing the active tokens at check layers in :func:`_checked_layer`) and
:func:`_finish` (the fused cache, and the suffix's logits when it rode along).

Shapes: K/V are ``[layers, kv_heads, tokens, head_dim]``; hidden states ``[1, q, hidden]``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
from torch.nn.attention.bias import CausalBias

from ragkv.gpu.attention import attention_kernel
from ragkv.gpu.feed import DeviceSink, LayerFeed
from ragkv.gpu.graphs import layer_graphs, probe_attend
from ragkv.gpu.tier import release
from ragkv.model import AttentionProbe, ModelAdapter, ScatterCache, Steer
from ragkv.model.masks import PositionMask, causal_mask_at
from ragkv.selection import SelectionState, Strategy, StrategyParams, strategy_class
from ragkv.types import ChunkKV

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicCache

logger = logging.getLogger(__name__)

__all__ = [
    "FusedContext",
    "FusionConfig",
    "FusionInput",
    "PieceBudget",
    "Pieces",
    "SuffixLogits",
    "drain",
    "fuse",
    "fuse_steps",
]

T = TypeVar("T")
SuffixLogits = Literal["all", "last"]  # where fusion's suffix logits are computed: every suffix row, or the last
Pieces = Generator[None, None, T]  # a pass run in pieces: each next() runs one, the return value is the result


class PieceBudget:
    """How much work a pass run in pieces does before it pauses, asked afresh before each piece.

    :meth:`tokens` is the next piece's size in prompt tokens through every layer (None: run on to
    the end without pausing); :meth:`seconds`, where not None, its time instead, for the layer
    loops that can look at the clock; :meth:`spent` hears what each piece did, so a budget sized
    in time (the answer driver's) can learn the rate. This base is a fixed size:
    ``PieceBudget(256)``.

    >>> b = PieceBudget(256)
    >>> b.tokens(), PieceBudget.of(64).tokens(), PieceBudget.of(None)
    (256, 64, None)
    """

    def __init__(self, tokens: int | None = None) -> None:
        if tokens is not None and tokens < 1:
            raise ValueError(f"a piece needs >= 1 token (or None: one piece), got {tokens}")
        self._tokens = tokens

    def tokens(self) -> int | None:
        """The next piece's size in prompt tokens (a fused pass counts token passes over layers / layers)."""
        return self._tokens

    def seconds(self) -> float | None:
        """The next piece's time, for passes that can look at the clock between layers (a fused pass:
        its question probe and its recompute pass); None: they go by :meth:`tokens`."""
        return None

    def spent(self, tokens: float, seconds: float) -> None:
        """The piece just run did ``tokens`` tokens of work in ``seconds`` (its own compute, pauses excluded)."""

    @classmethod
    def of(cls, step: int | PieceBudget | None) -> PieceBudget | None:
        """``step`` as a budget: a size in tokens becomes a fixed one; None stays None (one piece)."""
        if step is None or isinstance(step, PieceBudget):
            return step
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step_tokens must be an int >= 1, a PieceBudget or None (one piece), got {step!r}")
        return cls(step)


def drain(pieces: Pieces[T]) -> T:
    """Run every piece of ``pieces`` now and return its result."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class FusionConfig:
    """How to fuse chunk caches. Defaults come from ``ragkv bench fusion`` (docs/benchmarks.md).

    ``params`` takes the method's own record, named by ``strategy_class(method).Params``, e.g.
    ``FusionConfig(method="blend", ratio=0.15, params=BlendParams(deviation="kv"))``; a record of
    another method raises TypeError naming the right one.
    """

    method: str = "query_focus"  # strategy name, see ragkv.selection.available_strategies()
    ratio: float = 0.15  # share of chunk tokens recomputed through all layers
    params: StrategyParams | None = None  # the method's own knobs; None = the method's defaults

    def __post_init__(self) -> None:
        self.strategy()  # unknown method, ratio out of range, wrong params record: fail here

    def strategy(self) -> Strategy:
        """The selection strategy this config names, with its ratio and parameters."""
        return strategy_class(self.method)(self.ratio, self.params)


@dataclass(frozen=True, slots=True)
class FusionInput:
    """What fusion needs for one prompt."""

    prefix: ChunkKV  # exact KV of the shared prefix, positions 0..P-1
    chunks: Sequence[ChunkKV]  # each chunk's cached KV, at whatever positions it was computed
    chunk_ids: Sequence[Sequence[int]]  # each chunk's token ids (to embed recomputed tokens)
    suffix_ids: Sequence[int] = ()  # question + generation prompt (query-aware selection reads it)
    forced: Sequence[bool] = ()  # per chunk: True = no cache (placeholder KV), recompute every token
    # per chunk [tokens] deviation recorded at index time (experiments/craft.py record_deviation): only the
    # craft methods read it, and they refuse to run without it
    stored_scores: Sequence[torch.Tensor] | None = None
    # per chunk: a device-tier entry to fill as the chunk lands (ragkv.gpu), or None; () = none
    sinks: Sequence[DeviceSink | None] = ()


@dataclass(slots=True)
class FusedContext:
    """The fused prompt cache, ready for the suffix."""

    cache: DynamicCache  # prefix + chunks at positions 0..N-1 (+ the suffix after, with prefill_suffix)
    num_tokens: int  # N: prefix + chunk tokens (the suffix starts here)
    recomputed_tokens: int  # cached chunk tokens recomputed through every layer after the check layers
    chunk_tokens: int  # all chunk tokens
    forced_tokens: int = 0  # tokens of uncached segments, computed through every layer
    selected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # final slots
    # fp32 when fused with prefill_suffix: [suffix, vocab], or [1, vocab] (the last row's) with logits="last"
    suffix_logits: torch.Tensor | None = None
    # rows run through a whole decoder layer, summed over layers (the recompute's work; a row that
    # only wrote its K/V at a layer, under 2% of the layer's weights, is not counted)
    token_passes: int = 0
    # An adaptive share (QueryFocusParams.coverage): the share of chunk tokens its target wanted
    # (None: no target ran), and whether the cap (the ratio) held it back; then the cap was recomputed.
    wanted_share: float | None = None
    selection_capped: bool = False


@dataclass(frozen=True, slots=True)
class _Placed:
    """The naively placed context: what :func:`_place` returns."""

    keys: torch.Tensor  # [layers, kv_heads, n_ctx + extra, head_dim], model dtype and device
    values: torch.Tensor  # same
    slots: torch.Tensor  # [n_chunk] cache slot of every chunk token (CPU)
    ids: torch.Tensor  # [n_chunk] token id of every chunk token (CPU)
    n_ctx: int  # prefix + chunk tokens; slots n_ctx.. are free (for the suffix)
    feed: LayerFeed  # fills keys/values layer by layer: call feed.ready(layer) before reading a layer


def fuse(
    adapter: ModelAdapter,
    inp: FusionInput,
    config: FusionConfig | None = None,
    *,
    prefill_suffix: bool = False,
    logits: SuffixLogits = "all",
) -> FusedContext:
    """Fuse ``inp`` into one cache, recomputing the tokens ``config``'s strategy selects.

    With ``prefill_suffix``, the suffix runs through every layer together with the recomputed
    tokens (it sees each layer's fused K/V, exactly as a prefill after fusion would) and the
    result holds its logits (``logits``: ``"all"`` ``[S, vocab]``, or ``"last"`` ``[1, vocab]``, all
    an answer samples from: the LM head over a 150K vocabulary reads its weights once per row
    block) and K/V: one pass over the layers instead of two.
    """
    return drain(fuse_steps(adapter, inp, config, prefill_suffix=prefill_suffix, logits=logits))


@torch.no_grad()
def fuse_steps(
    adapter: ModelAdapter,
    inp: FusionInput,
    config: FusionConfig | None = None,
    *,
    prefill_suffix: bool = False,
    step_tokens: int | PieceBudget | None = None,
    logits: SuffixLogits = "all",
) -> Pieces[FusedContext]:
    """:func:`fuse` in pieces, for a server that runs decode steps between them (Sarathi-style).

    The recompute pass pauses (yields) between decoder layers once its layer passes since the last
    pause reach about ``step_tokens`` tokens through every layer (``step_tokens * layers`` token
    passes), so one piece costs about what a ``step_tokens``-token prefill chunk costs; a
    :class:`PieceBudget` is asked the size before each piece and told what each did. Placement
    and the question probe are the first piece; a budget with a time (``PieceBudget.seconds``)
    cuts the probe and the recompute pass by the clock instead: a piece ends before the layer
    that, timed as the one before it, would take it past that time. ``None``: one piece. The result is exactly
    :func:`fuse`'s: only where other work may run changes (nothing else may touch the model's
    attention probe or these tensors meanwhile; the caller holds the model lock per piece).
    """
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' (every suffix row's) or 'last' (the last row's), got {logits!r}")
    budget = PieceBudget.of(step_tokens)
    strategy = (config or FusionConfig()).strategy()
    suffix = torch.as_tensor(list(inp.suffix_ids), dtype=torch.long)  # [S]
    # Past a LongRoPE / dynamic-NTK model's original context (or a sliding window) the model's own
    # prefill switches frequencies for every position, and caches made before would silently differ.
    adapter.check_context(inp.prefix.num_tokens + sum(len(ids) for ids in inp.chunk_ids) + suffix.numel())
    probe = strategy.wants_query_attention and suffix.numel() > 0
    placed = _place(adapter, inp, suffix.numel() if (probe or prefill_suffix) else 0)
    try:
        state = SelectionState.start([len(ids) for ids in inp.chunk_ids])
        state.stored_scores = _stored_scores(inp)
        if strategy.wants_numbers and placed.ids.numel():
            state.number_runs = adapter.number_runs(placed.ids)
        if probe and placed.slots.numel() > 0:
            slots = placed.slots.to(adapter.device, non_blocking=True)
            keys, values, n_ctx = placed.keys, placed.values, placed.n_ctx
            state.query_attention = yield from _question_attention_steps(
                adapter, keys, values, suffix, n_ctx, slots, placed.feed, budget
            )
        forced = _forced_tokens(inp)
        active = _union(strategy.initial(state), forced)  # indices into the chunk tokens
        tail = suffix if prefill_suffix else suffix[:0]  # rides along after the active tokens
        if (placed.slots.numel() == 0 or active.numel() == 0) and not tail.numel():
            return _reused(adapter, placed)
        if placed.slots.numel() == 0:
            active = active[:0]
        # With no chunk token active the tail alone runs the layers, writing its K/V into the slots
        # kept free for it: no cache grows by concatenation (a copy of the whole context per layer).
        if budget is not None:
            yield  # placement and the question probe were this piece
        active, hidden, passes = yield from _recompute(adapter, strategy, state, placed, active, forced, tail, budget)
        fused = _finish(adapter, placed, active, forced, hidden, tail.numel(), passes, logits)
        fused.wanted_share, fused.selection_capped = state.wanted_share, state.capped
        return fused
    except BaseException:  # failed or closed: the staging thread stops and lets the buffer go
        placed.feed.cancel()
        raise


def _place(adapter: ModelAdapter, inp: FusionInput, extra: int) -> _Placed:
    """The chunks re-rotated to their offsets in one buffer with ``extra`` free slots at the end.

    The buffer fills layer by layer (:class:`~ragkv.gpu.feed.LayerFeed`): host chunks cross to a
    GPU on a copy stream while earlier layers compute. Out of device memory, the device tier is
    emptied and the buffer allocated once more before the error goes to the caller.
    """
    if len(inp.chunks) != len(inp.chunk_ids):
        raise ValueError("FusionInput needs one token-id list per chunk")
    for kv, tok in zip(inp.chunks, inp.chunk_ids, strict=True):
        if kv.num_tokens != len(tok):
            raise ValueError(f"chunk cache has {kv.num_tokens} tokens but {len(tok)} token ids were given")
    fps = {p.model_fingerprint for p in (inp.prefix, *inp.chunks)}
    if len(fps) != 1:
        raise ValueError(f"cannot fuse caches of different models: {sorted(fps)}")
    try:
        feed = LayerFeed(adapter, inp.prefix, inp.chunks, extra, sinks=inp.sinks)
    except torch.OutOfMemoryError:
        logger.warning("out of device memory placing %d chunks; emptying the device tier", len(inp.chunks))
        release(adapter.device)
        feed = LayerFeed(adapter, inp.prefix, inp.chunks, extra, sinks=inp.sinks)
    ids = [torch.as_tensor(list(tok), dtype=torch.long) for tok in inp.chunk_ids]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return _Placed(feed.keys, feed.values, torch.arange(feed.n_prefix, feed.n_ctx), flat, feed.n_ctx, feed)


def _reused(adapter: ModelAdapter, placed: _Placed) -> FusedContext:
    """Nothing to recompute and no tail: the placed cache as is (views, no copy)."""
    placed.feed.all_ready()
    n_ctx = placed.n_ctx
    cache = adapter.dynamic_cache(placed.keys[:, :, :n_ctx], placed.values[:, :, :n_ctx])
    return FusedContext(cache, n_ctx, 0, int(placed.slots.numel()))


def _recompute(
    adapter: ModelAdapter,
    strategy: Strategy,
    state: SelectionState,
    placed: _Placed,
    active: torch.Tensor,
    forced: torch.Tensor,
    tail: torch.Tensor,
    budget: PieceBudget | None = None,
) -> Pieces[tuple[torch.Tensor, torch.Tensor, int]]:
    """Run the ``active`` chunk tokens and the ``tail`` through every layer, narrowing at check layers.

    Writes the fresh K/V into ``placed.keys``/``placed.values`` (the scatter cache's layers are
    views of them). Returns the chunk tokens active after the last layer, the last layer's hidden
    states (``[1, active + tail, hidden]``; the tail's alone where the chunk rows only wrote their
    K/V there, :class:`_Rows`) and the token passes run (rows that ran a layer whole, summed over layers). Pauses
    after a layer once the token passes since the last pause reach ``budget``'s size times the
    layers (None: never), and tells ``budget`` what each piece did.
    """
    cache = adapter.scatter_cache(placed.keys, placed.values)
    checks = set(strategy.check_layers(state, adapter.spec.num_layers)) if active.numel() else set()
    state.checks = tuple(sorted(checks))  # a strategy may act differently at its last check
    # Positions are assembled on the host (the mask is chosen from them without a device sync) and
    # move to the device once per active set. Between check layers the loop runs layer after layer
    # with nothing read back: no host sync (tests/core/test_host_syncs.py counts them).
    tail_pos = torch.arange(placed.n_ctx, placed.n_ctx + tail.numel())  # [S]
    hidden = adapter.embed(placed.ids[active])  # [1, active, hidden]
    if tail.numel():
        hidden = torch.cat([hidden, adapter.embed(tail)], dim=1)  # [1, active + S, hidden]
    step: _Step | None = None
    clock = _LayerClock(budget, adapter.spec.num_layers)
    rows = _Rows(adapter, placed, tail_pos, adapter.writes_layer_kv)
    for layer in range(adapter.spec.num_layers):
        if clock.due():
            yield from clock.pause()
        placed.feed.ready(layer)
        if step is None:  # the active set changed: new positions, mask and rotary tables
            step = _Step.at(adapter, torch.cat([placed.slots[active], tail_pos]), placed.keys.shape[2], hidden)
        if layer in checks:
            active, hidden, step, whole = _checked_layer(
                adapter, strategy, state, cache, layer, step, hidden, active, forced, rows
            )
        elif rows.trim and layer == rows.last and active.numel():  # the chunk rows need only their K/V here
            rows.write_kv(cache, layer, step, hidden, int(active.numel()))
            hidden, step = rows.run_rest(cache, layer, step, hidden, int(active.numel()), active[:0])
            whole = int(hidden.shape[1])
        else:
            whole = int(hidden.shape[1])
            hidden = _run_layer(adapter, layer, hidden, step, cache)
        clock.ran(whole)
        if active.numel() == 0 and not tail.numel():
            break
    clock.end()
    return active, hidden, clock.passes


class _LayerClock:
    """When a layer loop run in pieces pauses: the question probe's and the recompute pass's.

    Asked before each layer (:meth:`due`). With a budget that has a time (``PieceBudget.seconds``)
    a piece ends before the layer that, timed as the last one, would take it past that time (on
    a CPU, where the clock sees the work; the driver gives accelerators sizes, not times). With a
    size, once the token passes since the last pause reach the size times the layers
    (``by_tokens``; the probe goes by time only: with a size it stays whole). A piece runs at
    least one layer. Each piece's work goes to the budget's ``spent`` (``report``).
    """

    def __init__(self, budget: PieceBudget | None, layers: int, *, by_tokens: bool = True, report: bool = True) -> None:
        self.budget, self.layers, self.by_tokens, self.report = budget, layers, by_tokens, report
        self.passes = 0  # token passes through a layer (tokens summed over layers), all pieces
        self._piece()

    def _piece(self) -> None:
        b = self.budget
        self.seconds = b.seconds() if b is not None else None
        tokens = b.tokens() if b is not None and self.by_tokens and self.seconds is None else None
        self.limit = None if tokens is None else tokens * self.layers
        self.began = self.mark = time.perf_counter()
        self.done, self.last = 0, 0.0  # this piece's token passes; the last layer's seconds

    def due(self) -> bool:
        """Whether the piece ends before the next layer."""
        if not self.done:
            return False
        if self.seconds is not None:
            return time.perf_counter() - self.began + self.last > self.seconds
        return self.limit is not None and self.done >= self.limit

    def ran(self, passes: int) -> None:
        """A layer ran ``passes`` tokens."""
        now = time.perf_counter()
        self.last, self.mark = now - self.mark, now
        self.done += passes
        self.passes += passes

    def pause(self) -> Pieces[None]:
        """End the piece (yield), then start the next."""
        self.end()
        yield
        self._piece()

    def end(self) -> None:
        """Tell the budget what the piece did."""
        if self.report and self.budget is not None and self.done:
            self.budget.spent(self.done / self.layers, time.perf_counter() - self.began)


@dataclass(frozen=True, slots=True)
class _Step:
    """What a layer needs for the tokens running it; rebuilt only when the active set changes."""

    pos: torch.Tensor  # [q] positions (= cache slots) of the active tokens, then the tail; on the device
    host_pos: torch.Tensor  # the same on the host
    # the exact causal mask over the slots, shared by every layer: made only where an attention call
    # needs it, a block of rows at a time where it would be large (ModelAdapter.position_mask)
    mask: torch.Tensor | PositionMask
    rope: tuple[torch.Tensor, torch.Tensor]  # cos/sin [1, q, rot_dim]
    steer: Steer  # the positions for the CPU's native attention kernel where it runs (ModelAdapter.scattered)

    @classmethod
    def at(cls, adapter: ModelAdapter, pos: torch.Tensor, num_slots: int, hidden: torch.Tensor) -> _Step:
        """The step for the tokens at host positions ``pos`` ``[q]``."""
        device_pos = pos.to(adapter.device, non_blocking=True)
        mask = adapter.position_mask(pos, num_slots, hidden.dtype, device_pos, attention_kernel(adapter))
        steer = adapter.scattered(pos)
        return cls(device_pos, pos, mask, adapter.position_embeddings(device_pos, hidden), steer)


class _Rows:
    """Which rows run a layer whole. A row whose output nothing reads needs only the layer's K/V
    (:meth:`ModelAdapter.write_layer_kv`, where the model's layers can run in parts: ``trim``): the
    tokens a check layer drops, measured on their K/V there, and every chunk row in the last layer,
    whose output no later layer reads (only the tail's goes on to the logits). They skip the
    layer's query, attention, output projection and MLP (about 98% of its weights); what is written
    is computed by the whole layer's own operations (``ModelAdapter.write_layer_kv``). Without
    ``trim`` every active row runs every layer whole.
    Token passes count the rows that ran a layer whole.
    """

    def __init__(self, adapter: ModelAdapter, placed: _Placed, tail_pos: torch.Tensor, trim: bool) -> None:
        self.adapter, self.placed, self.tail_pos, self.trim = adapter, placed, tail_pos, trim
        self.last = adapter.spec.num_layers - 1

    def write_kv(self, cache: ScatterCache, layer: int, step: _Step, hidden: torch.Tensor, n: int) -> None:
        """Layer ``layer``'s K/V for the first ``n`` rows of ``hidden`` (at ``step``'s first ``n`` positions)."""
        cos, sin = step.rope
        self.adapter.write_layer_kv(layer, hidden[:, :n], step.pos[:n], cache, (cos[:, :n], sin[:, :n]))

    def run_rest(
        self, cache: ScatterCache, layer: int, step: _Step, hidden: torch.Tensor, n: int, run: torch.Tensor
    ) -> tuple[torch.Tensor, _Step | None]:
        """Layer ``layer`` once the first ``n`` rows (chunk tokens) have their K/V written: the rows ``run``
        (indices among those ``n``, on the host) and the tail's run it whole. Returns their hidden
        states after it and the step for them (None: no row left)."""
        picked = torch.cat([run, torch.arange(n, hidden.shape[1])])
        hidden = hidden[:, picked.to(hidden.device, non_blocking=True)]
        if hidden.shape[1] == 0:
            return hidden, None
        slots = torch.cat([step.host_pos[run], self.tail_pos])
        step = _Step.at(self.adapter, slots, self.placed.keys.shape[2], hidden)
        return _run_layer(self.adapter, layer, hidden, step, cache), step


def _run_layer(
    adapter: ModelAdapter, layer: int, hidden: torch.Tensor, step: _Step, cache: ScatterCache
) -> torch.Tensor:
    """Decoder layer ``layer`` for the rows ``hidden`` ``[1, q, hidden]`` at ``step``: on a GPU replayed
    as CUDA graphs around the attention (:mod:`ragkv.gpu.graphs`), else the model's own layer."""
    graphs = layer_graphs(adapter, int(hidden.shape[1]), "recompute")
    if graphs is None:
        return adapter.run_layer(layer, hidden, step.pos, cache, step.rope, step.mask, step.steer)
    attend = functools.partial(
        adapter.layer_attention, layer, positions=step.pos, cache=cache, mask=step.mask, steer=step.steer
    )
    return graphs.run(layer, hidden, step.rope, attend)


def _checked_layer(
    adapter: ModelAdapter,
    strategy: Strategy,
    state: SelectionState,
    cache: ScatterCache,
    layer: int,
    step: _Step,
    hidden: torch.Tensor,
    active: torch.Tensor,
    forced: torch.Tensor,
    rows: _Rows,
) -> tuple[torch.Tensor, torch.Tensor, _Step | None, int]:
    """Run check layer ``layer``, measure the active tokens' K/V deviation, keep those the strategy selects.

    Returns the narrowed active set, the hidden rows after the layer (the kept tokens', then the
    tail's; the tail's alone at the last layer with ``rows.trim``), the step for them (None: build
    it anew) and how many rows ran the layer whole. With ``rows.trim`` the active tokens' K/V are
    written first and only the kept rows run the rest of the layer; without, every active row runs
    it whole, then the others are dropped.
    """
    n_active = int(active.numel())
    pos = step.pos[:n_active]  # the active tokens' slots (the tail's come after)
    layer_k, layer_v = cache.layer_kv(layer)  # [1, H, slots, D]
    old_k, old_v = layer_k[:, :, pos].clone(), layer_v[:, :, pos].clone()  # [1, H, active, D]
    if rows.trim:
        rows.write_kv(cache, layer, step, hidden, n_active)
    else:
        hidden = adapter.run_layer(layer, hidden, step.pos, cache, step.rope, step.mask, step.steer)
    layer_k, layer_v = cache.layer_kv(layer)
    k_dev, v_dev = _deviation(layer_k[:, :, pos], old_k), _deviation(layer_v[:, :, pos], old_v)
    strategy.observe(state, layer, active, k_dev=k_dev, v_dev=v_dev)
    is_forced = torch.isin(active, forced)
    state.deviations[layer][is_forced] = 0.0  # uncached tokens never compete for the budget
    keep = _union(strategy.select(state, layer), torch.nonzero(is_forced).flatten())  # positions within `active`
    if rows.trim:
        hidden, after = rows.run_rest(cache, layer, step, hidden, n_active, keep if layer != rows.last else keep[:0])
        return active[keep], hidden, after, int(hidden.shape[1])
    whole = int(hidden.shape[1])
    picked = torch.cat([keep, torch.arange(n_active, whole)])  # kept tokens, then the tail
    return active[keep], hidden[:, picked.to(hidden.device, non_blocking=True)], None, whole


def _finish(
    adapter: ModelAdapter,
    placed: _Placed,
    active: torch.Tensor,
    forced: torch.Tensor,
    hidden: torch.Tensor,
    tail: int,
    passes: int,
    wanted: SuffixLogits = "all",
) -> FusedContext:
    """The fused cache (prefix, chunks, and the tail's K/V when it rode along) and the tail's logits
    (``wanted``: every tail row's, or the last one's)."""
    placed.feed.all_ready()  # the loop stops early once no token is left to recompute
    rows = tail if wanted == "all" else min(tail, 1)
    logits = adapter.final_logits(hidden[:, hidden.shape[1] - rows :])[0] if tail else None  # [rows, vocab]
    kept = placed.n_ctx + tail
    return FusedContext(
        adapter.dynamic_cache(placed.keys[:, :, :kept], placed.values[:, :, :kept]),
        placed.n_ctx,
        int(active.numel()) - int(forced.numel()),
        int(placed.slots.numel()),
        forced_tokens=int(forced.numel()),
        selected=placed.slots[active.cpu()],
        suffix_logits=logits,
        token_passes=passes,
    )


def _deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 deviation ``[q]`` between ``[1, H, q, D]`` tensors."""
    diff = (fresh.float() - cached.float()).pow(2).sum(dim=(0, 1, 3))
    return (diff / cached.float().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)).sqrt()


def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted union of two index tensors."""
    return torch.unique(torch.cat([a.cpu(), b.cpu()])) if b.numel() else a


def _stored_scores(inp: FusionInput) -> torch.Tensor | None:
    """The chunks' stored scores as one ``[chunk tokens]`` float32 tensor on the CPU (None when not given)."""
    if inp.stored_scores is None:
        return None
    if len(inp.stored_scores) != len(inp.chunk_ids):
        raise ValueError(f"stored_scores has {len(inp.stored_scores)} entries for {len(inp.chunk_ids)} chunks")
    for scores, ids in zip(inp.stored_scores, inp.chunk_ids, strict=True):
        if scores.shape != (len(ids),):
            raise ValueError(f"a chunk of {len(ids)} tokens has stored scores of shape {tuple(scores.shape)}")
    parts = [s.float().cpu() for s in inp.stored_scores]
    return torch.cat(parts) if parts else torch.zeros(0)


def _forced_tokens(inp: FusionInput) -> torch.Tensor:
    """Indices (among chunk tokens) of the tokens of uncached segments."""
    out, start = [], 0
    for i, ids in enumerate(inp.chunk_ids):
        if i < len(inp.forced) and inp.forced[i]:
            out.append(torch.arange(start, start + len(ids)))
        start += len(ids)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _question_attention(
    adapter: ModelAdapter,
    keys: torch.Tensor,
    values: torch.Tensor,
    suffix: torch.Tensor,
    n_ctx: int,
    slots: torch.Tensor,
    feed: LayerFeed | None = None,
) -> torch.Tensor:
    """Attention the question pays each chunk token, per layer: ``[layers, n_chunk]``.

    Runs the suffix (a few dozen tokens: about 1% of a prefill) through every layer on the
    naively placed cache and records the attention weights, normalized per layer. Its K/V go to
    the free slots after the context (``keys``/``values`` have ``len(suffix)`` of them), which
    fusion overwrites or drops; the context slots are not touched. With ``feed``, each layer is
    made ready just before it runs, so the copy of later layers overlaps it.
    """
    return drain(_question_attention_steps(adapter, keys, values, suffix, n_ctx, slots, feed))


def _question_attention_steps(
    adapter: ModelAdapter,
    keys: torch.Tensor,
    values: torch.Tensor,
    suffix: torch.Tensor,
    n_ctx: int,
    slots: torch.Tensor,
    feed: LayerFeed | None = None,
    budget: PieceBudget | None = None,
) -> Pieces[torch.Tensor]:
    """:func:`_question_attention` in pieces: it pauses between layers where ``budget`` has a time
    (``PieceBudget.seconds``; with a size it runs whole). Its work is not reported to the budget:
    a probe token costs more than a prefill token (eager attention over the whole context)."""
    probe_cache = adapter.scatter_cache(keys, values)
    host_pos = torch.arange(n_ctx, n_ctx + len(suffix))  # [S]: the last S slots, so a causal bias, no mask tensor
    hidden = adapter.embed(suffix)  # [1, S, hidden]
    mask = adapter.causal_mask(host_pos, keys.shape[2], hidden.dtype)
    pos = host_pos.to(adapter.device, non_blocking=True)
    if isinstance(mask, CausalBias):  # SDPA on CUDA: the probe's eager attention would build it in every
        # layer (4 kernels); made once here as the fp32 scores' additive mask (the same probabilities)
        mask = causal_mask_at(pos, keys.shape[2], torch.float32, adapter.device)
    pe = adapter.position_embeddings(pos, hidden)
    probe = AttentionProbe(None)  # every layer's weights
    # on a GPU the layers replay as CUDA graphs (ragkv.gpu.graphs), unless the probe may pause
    # between layers: another request could then run the model's graphs in between
    graphs = layer_graphs(adapter, len(suffix), "probe") if budget is None or budget.seconds() is None else None
    if graphs is not None:
        with graphs.lock:  # the question's rows stay in the model's buffers from the first layer to the last
            graphs.start(hidden, pe)
            for layer in range(adapter.spec.num_layers):
                if feed is not None:
                    feed.ready(layer)
                layer_k, layer_v = probe_cache.layer_kv(layer)
                attend = probe_attend(probe, layer, graphs.parts[layer].scaling, layer_k, layer_v, pos, mask)
                # the last layer's output projection and MLP are not run: only its attention is read
                graphs.layer(layer, len(suffix), attend, whole=layer < adapter.spec.num_layers - 1)
        return _normalized(probe, slots, adapter.spec.num_layers)
    steer = replace(adapter.scattered(host_pos), probe=probe)  # on the CPU kernel where it runs
    clock = _LayerClock(budget, adapter.spec.num_layers, by_tokens=False, report=False)
    for layer in range(adapter.spec.num_layers):
        if clock.due():
            yield from clock.pause()
        if feed is not None:
            feed.ready(layer)
        hidden = adapter.run_layer(layer, hidden, pos, probe_cache, pe, mask, steer)
        clock.ran(len(suffix))
    return _normalized(probe, slots, adapter.spec.num_layers)


def _normalized(probe: AttentionProbe, slots: torch.Tensor, layers: int) -> torch.Tensor:
    """The probe's weights at the chunk ``slots``, normalized per layer: ``[layers, n_chunk]`` on the host."""
    per_layer = torch.stack([probe.weights[i][slots].float() for i in range(layers)])
    return (per_layer / per_layer.sum(dim=1, keepdim=True).clamp_min(1e-12)).cpu()
