"""The fused prefill's decoder layers replayed as CUDA graphs, per bucket of rows: the question
probe's and the recompute's.

Both passes run few rows through every layer on a GPU: the probe a few dozen question tokens, the
recompute a few hundred to a few thousand chunk tokens. Through transformers' eager layers each
layer is 44 kernel launches and their Python, about 2 ms of host time a layer on an H100's host:
the probe took 45-65 ms of wall time for 21 ms of device time at 16K tokens of Llama-3.1-8B's shape,
and at 4K tokens the recompute took 78 ms for about 15 ms of work (docs/benchmarks.md, "GPU"). Here
each layer runs as two graph replays with the attention between them eager:

- before the attention, one graph: the input norm, the query, key and value projections, Qwen3's
  head norms, the rotation (the operations of :mod:`ragkv.model.lean`, the modeling files' own);
- the attention, eager: the rows' keys and values written at their slots of the fused buffer, and
  the attention over every slot (the probe's :func:`ragkv.model.attention._probe_attention`, which
  records the weights; the recompute's through the model's attention function,
  :meth:`ModelAdapter.layer_attention`). Its inputs change address with every request (the fused
  buffer is the request's), so it cannot be captured; it is a few kernels;
- after it, one graph: the output projection, the residual, the post-attention norm, the MLP.

The graphs read and write static buffers, the model's, sized for the largest bucket and shared by
every bucket (:data:`BUCKETS`: 8 to 2,048 rows); fewer rows are padded with zero rows, which no
real row reads (every operation in the graphs is per row; the attention runs on the real rows
only). The probe keeps its rows in the buffers from its first layer to its last; the recompute,
which may pause between layers (another request's pass can run in between), loads its rows into
them for each layer and takes them out after it. The model's lock orders the passes on the host;
on the device they are ordered because every pass runs on the device's default stream (ragkv
computes on no other). Graphs are captured on first use of a bucket (or all at a server's start,
:func:`capture_all`), all of its layers in one go on a high-priority stream of the model's own
that no worker thread draws (``capture_error_mode="thread_local"``: the staging thread keeps
copying meanwhile), with that stream synchronized and torch's device cache emptied once per
bucket: ``torch.cuda.graph`` would synchronize the whole device and empty torch's device and
pinned-host caches before every graph (two per layer). One capture runs at a time in the process
(:data:`CAPTURE_LOCK`, which ``ragkv.gpu.release`` takes too); a model's graphs share one memory
pool (each graph's memory is its own temporaries, dead at its end) and live as long as the model.

Anything else runs eagerly as before: a CPU, a layer whose arithmetic ragkv does not know
(:func:`ragkv.model.lean.layer_parts`) or whose projections are not plain ``nn.Linear``, more rows
than the largest bucket (the pass is then bound by the device, not by launches), a probe run in
timed pieces (its rows stay in the model's buffers between layers), ``RAGKV_PROBE_GRAPHS=0`` or
``RAGKV_RECOMPUTE_GRAPHS=0``, or a capture that failed (logged once; the model's passes stay
eager; out of memory while capturing: eager for half a minute, then a capture is tried again).

The replays compute what the eager layers compute for the same rows (tested on CUDA against the
eager layers: bit for bit where the rows fill their bucket, within rounding where a product runs on
more rows: a request that ran eagerly, out of memory to capture, and the same request replayed
may differ in their last bits, as batches of other sizes do). On the CPU the same buffers and
order run without graphs (:class:`_Eager`,
``RAGKV_PROBE_GRAPHS=eager`` on a CPU model; on a GPU it captures as ``auto`` does), which is how
the tests check the plumbing there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

from ragkv.gpu import kernels
from ragkv.model import ModelAdapter
from ragkv.model.attention import AttentionProbe, _probe_attention
from ragkv.model.lean import LeanLayer, _norm, _rotate, _rotated_kv, _rotation, layer_parts

logger = logging.getLogger(__name__)

__all__ = [
    "BUCKETS",
    "CAPTURE_LOCK",
    "Attend",
    "LayerGraphs",
    "capture_all",
    "keep_eager",
    "layer_graphs",
    "probe_attend",
]

# rows a set of graphs is captured for: powers of two while the rows are few (launch-bound: padding
# costs nothing), then steps of 128 and 256, where padded rows cost device time (a quarter at most)
BUCKETS = (8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
Use = Literal["probe", "recompute"]
_ENVS: dict[str, str] = {"probe": "RAGKV_PROBE_GRAPHS", "recompute": "RAGKV_RECOMPUTE_GRAPHS"}
# What runs between a layer's two replays: (query [1, heads, n, D], key and value [1, kv_heads, n, D],
# rotated) -> the attention's output, n rows of heads x D in row order (e.g. [1, n, heads, D]).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Replay(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Sequence[Callable[[], None]]], list[_Replay]]


class _Eager:
    """A "graph" that runs its function again: the same buffers and order, for a device without graphs."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _eager(fns: Sequence[Callable[[], None]]) -> list[_Replay]:
    for fn in fns:  # as a capture's warm-up runs them
        fn()
    return [_Eager(fn) for fn in fns]


# One capture at a time in the process: a capture and an empty_cache() elsewhere (``ragkv.gpu.release``)
# must not overlap, nor two captures (the allocator routes a capture's allocations by stream).
CAPTURE_LOCK = threading.Lock()
_OOM_BACKOFF_S = 30.0  # after running out of memory while capturing, the passes stay eager this long


def _cuda_graphs(device: torch.device, pool: Any) -> Capture:
    """Captures for one model. Its stream is its own (cuBLAS keys workspaces by stream, and graphs
    bake theirs in: two models' graphs must not share one) and of high priority: ragkv's other
    streams (the feed's and the host tier's copies) come from torch's default-priority pool, so no
    worker thread can queue work on it while it captures."""
    streams: list[Any] = []

    def capture(fns: Sequence[Callable[[], None]]) -> list[_Replay]:
        if not streams:
            streams.append(torch.cuda.Stream(device, priority=-1))
        stream = streams[0]
        made: list[_Replay] = []
        with torch.cuda.device(device):  # the model's device, whichever is current
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for fn in fns:  # warm-up: cuBLAS workspaces, lazy inits
                    fn()
                stream.synchronize()  # the warm-up done; the device's other streams go on
                # the warm-up's temporaries are cached for this stream only, and a capture cannot take
                # the cache's blocks: give them back once (torch.cuda.graph does so before every graph)
                torch.cuda.empty_cache()
                for fn in fns:
                    graph = torch.cuda.CUDAGraph()
                    try:
                        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                        fn()
                        graph.capture_end()
                    except BaseException:
                        with contextlib.suppress(Exception):
                            graph.capture_end()  # the stream leaves capture mode (the capture is invalid)
                        # a capture invalid at its end (or before) can leave the allocator routing to the
                        # pool: capture_end checks the capture before it stops the routing
                        with contextlib.suppress(Exception):
                            torch._C._cuda_endAllocateToPool(device.index or 0, pool)
                        raise
                    made.append(graph)
            torch.cuda.current_stream().wait_stream(stream)
        return made

    return capture


class _Buffers:
    """A model's static buffers for :data:`BUCKETS`'s largest bucket; each bucket's graphs use its first rows."""

    def __init__(self, adapter: ModelAdapter, first: LeanLayer, rows: int) -> None:
        dev, dt = adapter.device, adapter.dtype
        hidden_size = int(adapter.model.config.hidden_size)
        d = first.head_dim
        # normal tensors, not inference ones: a pass run outside inference mode writes them too
        with torch.inference_mode(False), torch.no_grad():
            self.hidden = torch.zeros(1, rows, hidden_size, dtype=dt, device=dev)
            self.cos = torch.ones(1, rows, 1, d, dtype=dt, device=dev)
            self.sin = torch.zeros(1, rows, 1, d, dtype=dt, device=dev)
            self.swap = torch.cat([torch.arange(d // 2, d), torch.arange(0, d // 2)]).to(dev)
            self.q = torch.zeros(1, rows, first.heads, d, dtype=dt, device=dev)
            self.k = torch.zeros(1, rows, first.kv_heads, d, dtype=dt, device=dev)
            self.v = torch.zeros_like(self.k)
            self.attn = torch.zeros(1, rows, first.heads * d, dtype=dt, device=dev)
        self.rope: object = None  # the position embeddings whose tables cos/sin hold (None: none yet)

    def load_rope(self, position_embeddings: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
        cos, sin, _ = _rotation(*position_embeddings)  # [1, n, 1, D]
        self.cos[:, :n].copy_(cos)
        self.sin[:, :n].copy_(sin)
        self.rope = position_embeddings


class LayerGraphs:
    """One model's layers for passes of up to ``rows`` rows: two replays a layer over static buffers.

    Args:
        buffers: the model's static buffers (at least ``rows`` rows), on its device.
        parts: its decoder layers as parts (:func:`ragkv.model.lean.layer_parts`).
        rows: the bucket: rows the replays hold.
        capture: turns functions over the buffers into replays (CUDA graphs, or :class:`_Eager`).
        lock: the model's: held by a probe from its first layer to its last and by a recompute for
            each layer (:attr:`lock`), since every bucket uses the same buffers and memory pool.
    """

    def __init__(
        self,
        buffers: _Buffers,
        parts: tuple[LeanLayer, ...],
        rows: int,
        capture: Capture,
        lock: threading.RLock,
    ) -> None:
        self.lock = lock
        # no reference to the adapter or the model: the model is the key of a weak mapping (_MODELS)
        self.buffers, self.rows, self.parts = buffers, rows, parts
        b = buffers
        self.hidden, self.q, self.k, self.v, self.attn = (t[:, :rows] for t in (b.hidden, b.q, b.k, b.v, b.attn))
        self.cos, self.sin = b.cos[:, :rows], b.sin[:, :rows]
        with torch.no_grad():
            # the buffers hold finite values while capturing (zeros, tables, earlier rows): nothing overflows
            fns = [functools.partial(f, layer) for layer in parts for f in (self._before, self._after)]
            made = capture(fns)
        self.before, self.after = made[0::2], made[1::2]

    def _before(self, layer: LeanLayer) -> None:
        rows = (1, self.rows)
        x = _norm(layer.input_norm, self.hidden)
        q = layer.q_proj(x).view(*rows, layer.heads, layer.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = _norm(layer.q_norm, q)
        self.q.copy_(_rotate(q, self.cos, self.sin, self.buffers.swap))
        k, v = _rotated_kv(layer, x, rows, self.cos, self.sin, self.buffers.swap)
        self.k.copy_(k)
        self.v.copy_(v)

    def _after(self, layer: LeanLayer) -> None:
        hidden = self.hidden + layer.o_proj(self.attn)
        x = _norm(layer.post_norm, hidden)
        self.hidden.copy_(hidden + layer.down_proj(layer.act(layer.gate_proj(x)) * layer.up_proj(x)))

    @torch.no_grad()
    def start(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Load ``n`` rows ``[1, n, hidden]`` and their cos/sin ``[1, n, D]``; the padding rows to zero."""
        n = hidden.shape[1]
        self.hidden[:, :n].copy_(hidden)
        if n < self.rows:
            self.hidden[:, n:].zero_()
            self.attn[:, n:].zero_()  # the padding rows' attention stays 0
        if self.buffers.rope is not position_embeddings:
            self.buffers.load_rope(position_embeddings, n)

    @torch.no_grad()
    def layer(self, index: int, n: int, attend: Attend, *, whole: bool = True) -> None:
        """Decoder layer ``index`` for the first ``n`` rows of the buffers, ``attend`` between the replays;
        without ``whole``, the layer up to its attention only (a pass that reads nothing after it)."""
        self.before[index].replay()
        out = attend(self.q[:, :n].transpose(1, 2), self.k[:, :n].transpose(1, 2), self.v[:, :n].transpose(1, 2))
        if whole:
            self.attn[:, :n].copy_(out.reshape(1, n, -1))
            self.after[index].replay()

    @torch.no_grad()
    def run(
        self, index: int, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], attend: Attend
    ) -> torch.Tensor:
        """Decoder layer ``index`` over ``hidden`` ``[1, n, hidden]`` as a whole: the rows loaded, the
        layer run, a copy of its output returned (the buffers are the model's: another pass may run
        before this one's next layer)."""
        with self.lock:
            self.start(hidden, position_embeddings)
            self.layer(index, hidden.shape[1], attend)
            return self.hidden[:, : hidden.shape[1]].clone()


def probe_attend(
    probe: AttentionProbe,
    layer: int,
    scaling: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
) -> Attend:
    """The question probe's attention between a layer's replays: the question's keys and values
    written at their ``slots`` of ``keys``/``values`` (the layer's ``[1, kv_heads, slots, D]`` of the
    fused buffer), its attention over every slot recorded in ``probe``."""

    fused = kernels.probe_scale_mask(keys.device)  # the scores scaled and masked in one pass, where it runs

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        keys[:, :, slots] = key
        values[:, :, slots] = value
        return _probe_attention(probe, layer, query, keys, values, mask, scaling, fused)[0]

    return attend


class _ModelGraphs:
    """A model's layer graphs by bucket, made on first use; off for good where its layers cannot be
    replayed here (``parts`` None) or once a capture fails."""

    def __init__(self, capture: Capture | None, parts: tuple[LeanLayer, ...] | None) -> None:
        self.capture, self.parts = capture, parts
        self.buffers: _Buffers | None = None
        self.buckets: dict[int, LayerGraphs] = {}
        self.failed = parts is None
        self.retry_at = 0.0  # time.monotonic() before which no capture is tried (out of memory)
        self.lock = threading.Lock()  # making buckets
        self.running = threading.RLock()  # a pass running on the buffers: every bucket's (one memory pool)


_MODELS: weakref.WeakKeyDictionary[Any, _ModelGraphs] = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def _plain(part: LeanLayer) -> bool:
    """Whether a layer's projections are plain ``nn.Linear`` modules (what the graphs were written for)."""
    projections = (part.q_proj, part.k_proj, part.v_proj, part.o_proj, part.gate_proj, part.up_proj, part.down_proj)
    return all(type(m) is torch.nn.Linear for m in projections)


def _replayable(model: Any) -> tuple[LeanLayer, ...] | None:
    """``model``'s layers as parts where the graphs apply to them, else None."""
    parts = layer_parts(model)
    if not parts or any(hasattr(layer, "_hf_hook") for layer in model.model.layers):
        return None  # arithmetic ragkv does not know, or accelerate moving tensors between devices
    if not all(_plain(part) for part in parts):
        return None  # quantized or wrapped projections: their kernels were never captured here
    if getattr(model.config, "partial_rotary_factor", 1.0) != 1.0:
        return None  # the buffers rotate whole heads
    return parts


def _model_graphs(adapter: ModelAdapter) -> _ModelGraphs:
    """The model's graphs (made once per model: a layer loop asks for every layer)."""
    graphs = _MODELS.get(adapter.model)
    if graphs is not None:
        return graphs
    with _MODELS_LOCK:
        graphs = _MODELS.get(adapter.model)
        if graphs is None:
            parts = _replayable(adapter.model)
            capture = None
            if parts is not None and adapter.device.type == "cuda":
                device = adapter.device if adapter.device.index is not None else torch.device("cuda", 0)
                capture = _cuda_graphs(device, torch.cuda.graph_pool_handle())
            graphs = _MODELS[adapter.model] = _ModelGraphs(capture, parts)
    return graphs


def _wanted(adapter: ModelAdapter, use: Use) -> bool:
    setting = os.environ.get(_ENVS[use], "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    return adapter.device.type == "cuda" or setting == "eager"  # "eager": the CPU tests' switch


def layer_graphs(adapter: ModelAdapter, rows: int, use: Use) -> LayerGraphs | None:
    """The layer graphs for a pass of ``rows`` rows (``use``: the question probe or the recompute, each
    switched by its own setting), or None where the pass runs eagerly (see the module docstring).
    A caller that keeps its rows in the buffers across layers (:meth:`LayerGraphs.start`, then
    :meth:`LayerGraphs.layer`) holds :attr:`LayerGraphs.lock` from its first layer to its last."""
    if not _wanted(adapter, use) or rows > BUCKETS[-1] or rows < 1:
        return None
    graphs = _model_graphs(adapter)
    bucket = next(b for b in BUCKETS if b >= rows)
    made = graphs.buckets.get(bucket)
    if made is not None or graphs.failed:
        return made
    with graphs.lock:
        made = graphs.buckets.get(bucket)
        if made is not None or graphs.failed or graphs.parts is None or time.monotonic() < graphs.retry_at:
            return made
        try:
            # not while another pass replays from the pool, nor during another capture
            with graphs.running, CAPTURE_LOCK:
                if graphs.buffers is None:
                    graphs.buffers = _Buffers(adapter, graphs.parts[0], BUCKETS[-1])
                capture = graphs.capture or _eager
                made = LayerGraphs(graphs.buffers, graphs.parts, bucket, capture, graphs.running)
        except torch.OutOfMemoryError as e:  # no room now: eager for a while, then a capture again
            graphs.retry_at = time.monotonic() + _OOM_BACKOFF_S
            logger.info(
                "no device memory to capture the decoder layers (%s); they run eagerly for %.0f s", e, _OOM_BACKOFF_S
            )
            return None
        except Exception as e:  # a capture the device refuses: the eager layers, as before
            graphs.failed = True
            logger.warning("capturing the decoder layers as CUDA graphs failed (%s); they run eagerly", e)
            return None
        graphs.buckets[bucket] = made
        return made


def keep_eager(adapter: ModelAdapter) -> None:
    """Run ``adapter``'s model's passes through its own layers whatever the settings: for a host
    process whose GPU memory budget, streams and cache ragkv must not touch (vLLM's workers)."""
    with _MODELS_LOCK:
        _MODELS[adapter.model] = _ModelGraphs(None, None)


def capture_all(adapter: ModelAdapter, buckets: Sequence[int] = BUCKETS) -> int:
    """Capture the layer graphs of every bucket in ``buckets`` now (a server's start), so that no
    request pays a bucket's first capture (two graphs a layer). Returns the buckets ready; 0 where
    neither pass replays (a CPU model, both settings ``0``, layers not known here)."""
    use: Use | None = next((u for u in ("probe", "recompute") if _wanted(adapter, u)), None)  # type: ignore[misc]
    if use is None:
        return 0
    return sum(layer_graphs(adapter, b, use) is not None for b in buckets)
