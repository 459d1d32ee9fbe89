"""The question probe's decoder layers replayed as CUDA graphs, per bucket of question rows.

The probe runs a few dozen question tokens through every layer: on a GPU it is bound by the host,
not by the device. Through transformers' eager layers it launched 1,423 kernels at 16K tokens of
Llama-3.1-8B's shape (44 a layer) and took 45-65 ms of wall time for 21 ms of device time
(docs/benchmarks.md, "GPU"). Here each layer runs as two graph replays with the attention between
them eager:

- before the attention, one graph: the input norm, the query, key and value projections, Qwen3's
  head norms, the rotation (the operations of :mod:`ragkv.model.lean`, the modeling files' own);
- the attention, eager: the question's keys and values written at their slots of the fused buffer,
  and the probe's attention over every slot (:func:`ragkv.model.attention._probe_attention`, which
  records the weights). Its inputs change address with every request (the fused buffer is the
  request's), so it cannot be captured; it is a dozen kernels;
- after it, one graph: the output projection, the residual, the post-attention norm, the MLP.

The graphs read and write static buffers of one row bucket (8, 16, ..., 256 rows); a question of
fewer rows is padded with zero rows, which no real row reads (every operation in the graphs is per
row; the attention runs on the real rows only). Graphs are captured on first use of a bucket, on a
high-priority stream of their own that no worker thread draws (``capture_error_mode="thread_local"``:
the staging thread keeps copying meanwhile), one capture at a time in the process
(:data:`CAPTURE_LOCK`, which ``ragkv.gpu.release`` takes too); they share one memory pool per
model and live as long as the model. The first request of a bucket pays its captures: two per
layer, each with the device synchronized and torch's cache emptied (``torch.cuda.graph``).

Anything else runs eagerly as before: a CPU, a layer whose arithmetic ragkv does not know
(:func:`ragkv.model.lean.layer_parts`) or whose projections are not plain ``nn.Linear``, a
question of over 256 rows, a probe run in timed pieces (another request could run between them,
and the buffers are the model's), ``RAGKV_PROBE_GRAPHS=0``, or a capture that failed (logged once;
the model's probes stay eager; out of memory while capturing: eager this time only).

The replays compute what the eager layers compute for the same rows (tested on CUDA against the
eager probe: bit for bit where the question fills its bucket, within rounding where a product
runs on more rows). On the CPU the same buffers and order run without graphs
(:class:`_Eager`), which is how the tests check the plumbing there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ragkv.model import ModelAdapter
from ragkv.model.attention import AttentionProbe, _probe_attention
from ragkv.model.lean import LeanLayer, _norm, _rotate, _rotated_kv, _rotation, layer_parts

logger = logging.getLogger(__name__)

__all__ = ["BUCKETS", "CAPTURE_LOCK", "ProbeLayers", "probe_layers"]

BUCKETS = (8, 16, 32, 64, 128, 256)  # question rows a set of graphs is captured for
_ENV = "RAGKV_PROBE_GRAPHS"


class _Replay(Protocol):
    def replay(self) -> None: ...


class _Eager:
    """A "graph" that runs its function again: the same buffers and order, for a device without graphs."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()  # as a capture's warm-up runs it

    def replay(self) -> None:
        self.fn()


# One capture at a time in the process: a capture and an empty_cache() elsewhere (``ragkv.gpu.release``)
# must not overlap, nor two captures (the allocator routes a capture's allocations by stream).
CAPTURE_LOCK = threading.Lock()
_STREAMS: dict[torch.device, Any] = {}


def _capture_stream(device: torch.device) -> Any:
    """The stream graphs are captured on: one per device, of high priority. ragkv's other streams
    (the feed's and the host tier's copies) take default-priority streams from torch's pool, so no
    worker thread can queue work on this one while it captures."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return stream


def _cuda_graph(device: torch.device, pool: Any) -> Callable[[Callable[[], None]], _Replay]:
    def capture(fn: Callable[[], None]) -> _Replay:
        stream = _capture_stream(device)
        with torch.cuda.device(device):  # the model's device, whichever is current
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: cuBLAS workspaces, lazy inits
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    fn()
            except BaseException:
                # an invalidated capture can leave the allocator routing to the pool (torch checks the
                # capture's end before it stops routing, in the versions before the fix): stop it here
                with contextlib.suppress(Exception):
                    torch._C._cuda_endAllocateToPool(device.index or 0, pool)
                raise
        return graph

    return capture


class ProbeLayers:
    """One model's probe layers for questions of up to ``rows`` rows: static buffers, two replays a layer.

    Args:
        adapter: the model (on the device the buffers go to).
        parts: its decoder layers as parts (:func:`ragkv.model.lean.layer_parts`).
        rows: the bucket: rows the buffers and replays hold.
        capture: turns a function over the buffers into a replay (a CUDA graph, or :class:`_Eager`).
        lock: held by a probe from its first layer to its last (:attr:`lock`): the model's buckets
            share one memory pool, and engines that do not share a model lock may share the model.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        parts: tuple[LeanLayer, ...],
        rows: int,
        capture: Callable[[Callable[[], None]], _Replay],
        lock: threading.RLock | None = None,
    ) -> None:
        self.lock = lock or threading.RLock()
        first = parts[0]
        dev, dt = adapter.device, adapter.dtype
        hidden_size = int(adapter.model.config.hidden_size)
        self.rows, self.parts = rows, parts
        # normal tensors, not inference ones: a probe run outside inference mode writes them too
        with torch.inference_mode(False), torch.no_grad():
            self.hidden = torch.zeros(1, rows, hidden_size, dtype=dt, device=dev)
            self.cos = torch.ones(1, rows, 1, first.head_dim, dtype=dt, device=dev)
            self.sin = torch.zeros(1, rows, 1, first.head_dim, dtype=dt, device=dev)
            half = first.head_dim // 2
            self.swap = torch.cat([torch.arange(half, first.head_dim), torch.arange(0, half)]).to(dev)
            self.q = torch.zeros(1, rows, first.heads, first.head_dim, dtype=dt, device=dev)
            self.k = torch.zeros(1, rows, first.kv_heads, first.head_dim, dtype=dt, device=dev)
            self.v = torch.zeros_like(self.k)
            self.attn = torch.zeros(1, rows, first.heads * first.head_dim, dtype=dt, device=dev)
            self.before: list[_Replay] = []
            self.after: list[_Replay] = []
            for layer in parts:  # the buffers hold zeros and finite tables while capturing: nothing overflows
                self.before.append(capture(functools.partial(self._before, layer)))
                self.after.append(capture(functools.partial(self._after, layer)))
            self.hidden.zero_()
            self.attn.zero_()

    def _before(self, layer: LeanLayer) -> None:
        rows = (1, self.rows)
        x = _norm(layer.input_norm, self.hidden)
        q = layer.q_proj(x).view(*rows, layer.heads, layer.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = _norm(layer.q_norm, q)
        self.q.copy_(_rotate(q, self.cos, self.sin, self.swap))
        k, v = _rotated_kv(layer, x, rows, self.cos, self.sin, self.swap)
        self.k.copy_(k)
        self.v.copy_(v)

    def _after(self, layer: LeanLayer) -> None:
        hidden = self.hidden + layer.o_proj(self.attn)
        x = _norm(layer.post_norm, hidden)
        self.hidden.copy_(hidden + layer.down_proj(layer.act(layer.gate_proj(x)) * layer.up_proj(x)))

    @torch.no_grad()
    def start(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Load a question's embedded rows ``[1, S, hidden]`` and their cos/sin ``[1, S, D]``."""
        n = hidden.shape[1]
        cos, sin, _ = _rotation(*position_embeddings)  # [1, S, 1, D]
        self.hidden[:, :n].copy_(hidden)
        self.hidden[:, n:].zero_()
        self.cos[:, :n].copy_(cos)
        self.sin[:, :n].copy_(sin)
        self.attn.zero_()  # the padding rows' attention stays 0

    @torch.no_grad()
    def layer(
        self,
        index: int,
        n: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        probe: AttentionProbe,
    ) -> None:
        """Decoder layer ``index`` for the first ``n`` rows: their K/V written into ``keys``/``values``
        (the layer's ``[1, kv_heads, slots, D]`` of the fused buffer) at ``slots``, their attention
        over it recorded in ``probe``."""
        part = self.parts[index]
        self.before[index].replay()
        keys[:, :, slots] = self.k[:, :n].transpose(1, 2)
        values[:, :, slots] = self.v[:, :n].transpose(1, 2)
        query = self.q[:, :n].transpose(1, 2)  # [1, H, n, D]
        out, _ = _probe_attention(probe, index, query, keys, values, mask, part.scaling)  # [1, n, H, D]
        self.attn[:, :n].copy_(out.reshape(1, n, -1))
        self.after[index].replay()


class _ModelGraphs:
    """A model's probe layers by bucket, made on first use; disabled for good once a capture fails."""

    def __init__(self, capture: Callable[[Callable[[], None]], _Replay] | None) -> None:
        self.capture = capture
        self.buckets: dict[int, ProbeLayers] = {}
        self.failed = False
        self.lock = threading.Lock()  # making buckets
        self.running = threading.RLock()  # a probe running: every bucket's (one memory pool)


_MODELS: weakref.WeakKeyDictionary[Any, _ModelGraphs] = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def _plain(part: LeanLayer) -> bool:
    """Whether a layer's projections are plain ``nn.Linear`` modules (what the graphs were written for)."""
    projections = (part.q_proj, part.k_proj, part.v_proj, part.o_proj, part.gate_proj, part.up_proj, part.down_proj)
    return all(type(m) is torch.nn.Linear for m in projections)


def _wanted(adapter: ModelAdapter) -> bool:
    setting = os.environ.get(_ENV, "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    return adapter.device.type == "cuda" or setting == "eager"  # "eager": the CPU tests' switch


def probe_layers(adapter: ModelAdapter, rows: int) -> ProbeLayers | None:
    """The probe layers for a question of ``rows`` rows, or None where the probe runs eagerly
    (see the module docstring). The caller holds their :attr:`ProbeLayers.lock` from the probe's
    first layer to its last: the buffers are the model's."""
    if not _wanted(adapter) or rows > BUCKETS[-1] or rows < 1:
        return None
    parts = layer_parts(adapter.model)
    if not parts or any(hasattr(layer, "_hf_hook") for layer in adapter.model.model.layers):
        return None
    if not all(_plain(part) for part in parts):
        return None  # quantized or wrapped projections: their kernels were never captured here
    if getattr(adapter.model.config, "partial_rotary_factor", 1.0) != 1.0:
        return None  # the buffers rotate whole heads
    with _MODELS_LOCK:
        graphs = _MODELS.get(adapter.model)
        if graphs is None:
            cuda = adapter.device.type == "cuda"
            device = adapter.device if adapter.device.index is not None else torch.device("cuda", 0)
            graphs = _MODELS[adapter.model] = _ModelGraphs(
                _cuda_graph(device, torch.cuda.graph_pool_handle()) if cuda else None
            )
    bucket = next(b for b in BUCKETS if b >= rows)
    with graphs.lock:
        if graphs.failed:
            return None
        made = graphs.buckets.get(bucket)
        if made is None:
            try:
                # not while another probe replays from the pool, nor during another capture
                with graphs.running, CAPTURE_LOCK:
                    made = ProbeLayers(adapter, parts, bucket, graphs.capture or _Eager, graphs.running)
            except torch.OutOfMemoryError as e:  # no room now: eager this time, a capture again later
                logger.info("no device memory to capture the question probe (%s); it runs eagerly this time", e)
                return None
            except Exception as e:  # a capture the device refuses: the eager layers, as before
                graphs.failed = True
                logger.warning("capturing the question probe as CUDA graphs failed (%s); it runs eagerly", e)
                return None
            graphs.buckets[bucket] = made
        return made
