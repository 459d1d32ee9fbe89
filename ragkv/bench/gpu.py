"""``ragkv bench gpu``: reuse against full prefill on a GPU, at Llama-3.1-8B's shape in bf16.

    ragkv bench gpu [--contexts 4096,16384,32768] [--chunk 512] [--codec raw:0] [--json out.json]
    ragkv bench gpu --tiny          # the same code on a tiny config, on the CPU when there is no GPU

A random-weight model of Llama-3.1-8B's shape (32 layers, 32 query and 8 KV heads of 128 dims,
llama3 RoPE scaling, a 128K vocabulary) is built on the GPU in bf16: no download; the weights do
not matter for time or memory. For each context length the prompt is a 16-token prefix, chunks of
``--chunk`` random tokens, and a 32-token question. Each chunk's cache is prefilled after the
prefix and encoded once, before any timing, as at index time (the 4K prompt is the first chunks
of the 32K one).

Timed, best of ``--repeats`` after one warm-up, the device synchronized around each run:

- full prefill: the whole prompt through the model from an empty cache (last position's logits);
- fused from host memory: every chunk's stored bytes decoded as the loader does (side by side on
  its decode threads; raw stays on the host and is staged layer by layer through pinned memory
  under the probe; entropy-coded levels decode onto the device), then fusion with the question
  riding along: the first token's logits;
- fused from host memory, int8: the same with the chunks stored in int8 (half raw's bytes; one
  fp16 scale per token and head), decoded onto the device as the loader does (the small integers
  cross, the multiply runs there): the compact layout against raw's;
- fused from the device tier: the same with the decoded chunks already in GPU memory;
- fused from pinned host memory (raw chunks on a GPU only): the decoded chunks already in
  page-locked host memory, crossing by DMA from where they are (what a pinned host tier of
  decoded chunks would cost: no checksum, no slab copy);
- the parts: the stored bytes' decode as the loader does it (checksums included; raw stays on the
  host), staging + placement from the host (the copy), the host half of staging alone (every
  layer of every host chunk into a staging slab on one thread, torch's threads inside each copy:
  "host slab GB/s", to tell a host-bound staging from a PCIe-bound one; and split over as many
  threads as the loader decodes on, at least 2: what parallel staging would reach; and fused from
  host memory with the feed's slab copies on as many threads, ``RAGKV_STAGE_THREADS``),
  placement from the device tier (the moved keys turned by ragkv's Triton kernel where it runs,
  :mod:`ragkv.gpu.kernels`; and through torch, ``RAGKV_TRITON=0``), the question probe (as
  fusion runs it: its layers replayed as CUDA graphs, ``ragkv.gpu.graphs``, its scores scaled and
  masked by ragkv's Triton kernel; the same with that kernel off, ``RAGKV_TRITON=0``; and through
  transformers' eager layers,
  ``RAGKV_PROBE_GRAPHS=0``), and the recompute
  (device-tier TTFT minus placement and probe; its layers replayed as CUDA graphs too where the
  recomputed rows fit a bucket; its attention from the rows' positions by ragkv's Triton kernel
  where ``ragkv.gpu.attention`` timed it faster than SDPA with the mask, "attention kernel" says
  which); the device-tier fusion with the recompute's attention through SDPA and its masks
  (``RAGKV_ATTENTION_KERNEL=0``) and through the kernel (``=1``); the device-tier fusion again with every layer eager
  (``RAGKV_RECOMPUTE_GRAPHS=0`` as well) and its recompute; and again with its causal masks made
  whole up front, as before :mod:`ragkv.model.masks` (time and peak: a mask above 64 MiB now runs a
  block of rows at a time);
- the bounds: the probe's weight reads at the measured HBM copy rate, the recompute's FLOPs
  (linear layers over the recomputed tokens, attention over the context) at the measured bf16
  matmul rate; the work bound counts the token passes the method ran (its focus share and check
  layers run more tokens through the early layers than the final 15%).

Peak memory is ``torch.cuda.max_memory_allocated`` during each run, weights included (and, for
the device tier, the tier's chunks). The layer graphs of every row bucket are captured before any
timing, as ``ragkv serve`` does at its start; replays allocate nothing, so their memory (static
buffers and the pool of their temporaries: the reserved memory the captures added) is a column
of its own, "graphs GiB", not in the peaks. KL is the first answer token's distribution, fused against
full prefill (a random model: a check that fusion ran, not a quality figure). Each row's JSON
(printed as it is measured) also gives ``elapsed_s``, the seconds since the measurements began,
and stderr the setup's (chunks stored, kernels checked, graphs captured), to size a lent device's
run; past ``--budget-s`` seconds the comparison columns are skipped (NaN), so that a run with a time
limit still measures every row's main ones. Without CUDA the command refuses, unless ``--tiny``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ragkv import codec
from ragkv.bench.table import Column, format_table
from ragkv.fusion import FusedContext, FusionConfig, FusionInput, _question_attention, fuse
from ragkv.gpu.attention import ENV as ATTENTION_ENV
from ragkv.gpu.attention import attention_kernel
from ragkv.gpu.feed import LayerFeed, pinned_pool, warm_kernels
from ragkv.gpu.graphs import capture_all
from ragkv.model import ModelAdapter, load_model, support
from ragkv.model.caches import cache_kwarg
from ragkv.retriever.decoding import decode_all, default_workers
from ragkv.types import ChunkKV, CodecSpec, StorageKey

LLAMA_3_1_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}
_PREFIX, _QUESTION = 16, 32  # tokens
_KEY = StorageKey("bench/gpu")


@dataclass(frozen=True, slots=True)
class _Prompt:
    prefix: list[int]
    chunks: list[list[int]]
    question: list[int]


def build_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> ModelAdapter:
    """A random-weight Llama of ``shape``, made on ``device`` in ``dtype`` (no host copy of 8B weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Random weights make deep layers' keys noisy enough in bf16 that the load-time check of exact
    # re-rotation (a tolerance meant for trained models) can fail by a hair; time and memory do not
    # depend on it, so the bench loosens it for its own random model only.
    with mock.patch.object(support, "_tolerance", lambda dtype: 0.15):
        return load_model((model.eval(), None), device=device, dtype=dtype)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float, Any]:
    """(best seconds, peak bytes allocated, last result) of ``fn`` over a warm-up and ``repeats`` runs."""
    best, peak, out = math.inf, 0.0, None
    for i in range(repeats + 1):
        out = None  # the previous run's result is freed before this run's peak is taken
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        if i:  # the first run warms kernels and allocators up
            best = min(best, time.perf_counter() - t0)
        if device.type == "cuda":
            peak = max(peak, float(torch.cuda.max_memory_allocated(device)))
    return best, peak, out


def _optional(
    name: str, measure: Callable[[], tuple[float, float, Any]], deadline: float | None = None
) -> tuple[float, float, Any]:
    """A measurement beside the table's main ones: NaN where it fails (said on stderr), so that one
    comparison column cannot cost a lent device's run its whole table; NaN too, not run, once the
    ``time.perf_counter()`` ``deadline`` (``--budget-s``) has passed."""
    if deadline is not None and time.perf_counter() > deadline:
        print(f"ragkv bench gpu: {name} skipped (past --budget-s); its column is nan", file=sys.stderr)
        return math.nan, math.nan, None
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - any failure: the column is NaN, the run goes on
        print(f"ragkv bench gpu: {name} failed ({type(e).__name__}: {e}); its column is nan", file=sys.stderr)
        return math.nan, math.nan, None


def whole_mask(self: ModelAdapter, pos: torch.Tensor, n: int, dtype: torch.dtype, *_: Any) -> torch.Tensor:
    """``ModelAdapter.position_mask`` as fusion made its masks before :mod:`ragkv.model.masks`: the whole
    tensor, up front (patched in to compare)."""
    return self.causal_mask(pos, n, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1))


def _prompt(vocab: int, context: int, chunk: int, seed: int = 0) -> _Prompt:
    g = torch.Generator().manual_seed(seed)
    n_chunks = max(1, (context - _PREFIX - _QUESTION) // chunk)
    ids = torch.randint(0, vocab - 8, (_PREFIX + n_chunks * chunk + _QUESTION,), generator=g).tolist()
    body = ids[_PREFIX : _PREFIX + n_chunks * chunk]
    return _Prompt(ids[:_PREFIX], [body[i : i + chunk] for i in range(0, len(body), chunk)], ids[-_QUESTION:])


@torch.inference_mode()
def _full_prefill(a: ModelAdapter, p: _Prompt) -> torch.Tensor:
    """The last position's logits ``[vocab]`` of the whole prompt, prefilled from an empty cache."""
    ids = torch.tensor([p.prefix + sum(p.chunks, []) + p.question], device=a.device)
    out = a.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(type(a.model)): a.build_cache([])})
    return out.logits[0, -1].float()


def _fused(a: ModelAdapter, prefix: ChunkKV, chunks: list[ChunkKV], p: _Prompt, config: FusionConfig) -> FusedContext:
    fused = fuse(a, FusionInput(prefix, chunks, p.chunks, p.question), config, prefill_suffix=True, logits="last")
    assert fused.suffix_logits is not None  # prefill_suffix always fills it
    return fused


def _decode_all(blobs: Sequence[bytes], a: ModelAdapter, spec: CodecSpec) -> list[ChunkKV]:
    """The chunks as the loader decodes them: side by side on its decode threads; raw stays on the
    host of a GPU model (fusion stages it)."""
    on_host = a.device.type == "cuda" and spec.name == "raw"
    device = "cpu" if on_host else a.device
    calls = [functools.partial(codec.decode, b, expect=None, device=device, dtype=a.dtype, view=on_host) for b in blobs]
    return decode_all(calls, default_workers(a.device.type))


def _feed(a: ModelAdapter, prefix: ChunkKV, chunks: list[ChunkKV], extra: int) -> LayerFeed:
    feed = LayerFeed(a, prefix, chunks, extra)
    feed.all_ready()
    return feed


def _slab_copy(chunks: list[ChunkKV], threads: int = 1) -> None:
    """The host half of staging alone: every layer of every host chunk copied into a staging slab
    (page-locked with CUDA) as the feed's worker copies it; nothing crosses. ``threads`` > 1 splits
    each layer's chunks over that many threads (torch's copies release the GIL): what parallel
    staging would reach."""
    host = [kv for kv in chunks if kv.keys.device.type == "cpu"]
    if not host:
        return
    first = host[0].keys
    columns = sum(kv.num_tokens for kv in host)
    shape = (2, first.shape[1], columns, first.shape[3])
    nbytes = math.prod(shape) * first.element_size()
    starts = [0]
    for kv in host:
        starts.append(starts[-1] + kv.num_tokens)
    pool = pinned_pool()
    slab = pool.take(nbytes)
    try:
        view = slab[:nbytes].view(first.dtype).view(shape)

        def copy(layer: int, part: range) -> None:
            for i in part:
                kv, col = host[i], starts[i]
                view[0, :, col : col + kv.num_tokens].copy_(kv.keys[layer])
                view[1, :, col : col + kv.num_tokens].copy_(kv.values[layer])

        parts = [range(i, len(host), threads) for i in range(min(threads, len(host)))]
        if len(parts) == 1:  # on this thread, as the feed's worker copies
            for layer in range(first.shape[0]):
                copy(layer, parts[0])
            return
        with ThreadPoolExecutor(len(parts)) as workers:
            for layer in range(first.shape[0]):
                list(workers.map(functools.partial(copy, layer), parts))
    finally:
        pool.give(slab)


def _split_threads(device: torch.device) -> int:
    """Threads the parallel staging measurements copy on: the loader's decode threads, at least 2."""
    return max(2, default_workers(device.type))


def _stored_bytes(chunks: list[ChunkKV]) -> int:
    """Bytes of the host chunks' K and V as stored (what staging copies on the host)."""
    return sum(kv.keys.nbytes + kv.values.nbytes for kv in chunks if kv.keys.device.type == "cpu")


def _probe(a: ModelAdapter, feed: LayerFeed, p: _Prompt) -> torch.Tensor:
    slots = torch.arange(feed.n_prefix, feed.n_ctx, device=a.device)
    return _question_attention(a, feed.keys, feed.values, torch.tensor(p.question), feed.n_ctx, slots)


def device_rates(device: torch.device) -> tuple[float, float]:
    """(HBM bytes/s of a device-to-device copy, counting read and write; bf16 matmul FLOP/s) on ``device``."""
    if device.type != "cuda":
        return math.nan, math.nan
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_s, _, _ = _timed(lambda: y.copy_(x), device, 5)
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_s, _, _ = _timed(lambda: m @ m, device, 5)
    return 2 * (1 << 30) / copy_s, 2 * 8192**3 / mm_s


def measure(
    a: ModelAdapter,
    contexts: Sequence[int],
    args: argparse.Namespace,
    measured: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """One table row per context length (see the module docstring); ``measured`` hears the rows so
    far after each one."""
    start = time.perf_counter()
    deadline = None if args.budget_s is None else start + args.budget_s  # for the comparison columns
    spec = CodecSpec(*_codec_spec(args.codec))
    longest = _prompt(a.spec.vocab_size, max(contexts), args.chunk)
    prefix = a.prefill_kv(longest.prefix)
    # each chunk also in int8 (half raw's bytes, dequantized on the device): the other layout a GPU
    # could keep and move (issue 34), beside the stored codec's; one chunk's KV alive at a time
    blobs: list[bytes] = []
    compact: list[bytes] | None = None if spec == _INT8 else []
    for c in longest.chunks:
        kv = a.prefill_kv(c, past=[prefix])
        blobs.append(codec.encode(kv, spec, key=_KEY).data)
        if compact is not None:
            compact.append(codec.encode(kv, _INT8, key=_KEY).data)
        del kv
    rates = device_rates(a.device)
    graphs_gib = _capture_graphs(a)
    setup_s = time.perf_counter() - start  # said on stderr: it sizes a lent device's run
    print(f"ragkv bench gpu: chunks stored, kernels checked, graphs captured after {setup_s:.0f} s", file=sys.stderr)
    rows = []
    for context in contexts:
        n = len(_prompt(a.spec.vocab_size, context, args.chunk).chunks)
        p = _Prompt(longest.prefix, longest.chunks[:n], longest.question)
        config = FusionConfig(method=args.method, ratio=args.ratio)
        int8 = None if compact is None else compact[:n]
        row = _row(a, prefix, p, blobs[:n], spec, config, args.repeats, rates, int8, deadline)
        rows.append({**row, "graphs_gib": graphs_gib, "elapsed_s": time.perf_counter() - start})
        if measured is not None:
            measured(rows)
    return rows


def _capture_graphs(a: ModelAdapter) -> float:
    """Every row bucket's layer graphs captured before any timing, as ``ragkv serve`` does at its
    start; their memory (the static buffers and the pool of their temporaries), in GiB. Replays
    allocate nothing, so the peaks measured after this leave the pool out: it is this figure."""
    if a.device.type != "cuda":
        return 0.0
    warm_kernels(a)  # ragkv's Triton kernels compiled and checked before timing, as ragkv serve does
    _sync(a.device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(a.device)
    capture_all(a)
    _sync(a.device)
    return (torch.cuda.memory_reserved(a.device) - before) / 2**30


def _row(
    a: ModelAdapter,
    prefix: ChunkKV,
    p: _Prompt,
    blobs: Sequence[bytes],
    spec: CodecSpec,
    config: FusionConfig,
    repeats: int,
    rates: tuple[float, float],
    int8_blobs: Sequence[bytes] | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """The measurements of one prompt whose chunks are stored as ``blobs`` (and, for the int8
    column, as ``int8_blobs``). Past ``deadline`` the comparison columns are NaN, not run (the
    main ones, the pinned host's and the attention's always run)."""
    dev = a.device

    def extra(name: str, measure: Callable[[], tuple[float, float, Any]]) -> tuple[float, float, Any]:
        return _optional(name, measure, deadline)

    full_s, full_peak, full = _timed(lambda: _full_prefill(a, p), dev, repeats)
    host_s, host_peak, fused = _timed(lambda: _fused(a, prefix, _decode_all(blobs, a, spec), p, config), dev, repeats)
    fused_logits = fused.suffix_logits[-1]
    del fused  # its cache is the whole context
    int8_s = math.nan  # fused from host memory, the chunks stored in int8
    if int8_blobs is not None:
        fn = lambda: _fused(a, prefix, _decode_all(int8_blobs, a, _INT8), p, config)  # noqa: E731
        int8_s = extra("from host, int8", lambda: _timed(fn, dev, repeats))[0]
    decode_s, _, decoded = _timed(lambda: _decode_all(blobs, a, spec), dev, repeats)
    # [0]: a result held past its timing (a feed is the whole context) would count in the next peak
    copy_s = _timed(lambda: _feed(a, prefix, decoded, len(p.question)), dev, repeats)[0]
    slab_s = _timed(lambda: _slab_copy(decoded), dev, repeats)[0]  # its host half: is staging bound by the host?
    threads = _split_threads(dev)
    split_slab = lambda: _slab_copy(decoded, threads)  # noqa: E731
    slab_threads_s = extra("host slab on threads", lambda: _timed(split_slab, dev, repeats))[0]
    host_threads_s = math.nan  # fused from host memory with the slab copies on that many threads
    if _stored_bytes(decoded):
        with mock.patch.dict(os.environ, {"RAGKV_STAGE_THREADS": str(threads)}):
            fn = lambda: _fused(a, prefix, _decode_all(blobs, a, spec), p, config)  # noqa: E731
            host_threads_s = extra("staging on threads", lambda: _timed(fn, dev, repeats))[0]
    # what a host tier of decoded chunks in page-locked memory would cost (no decode, no slab copy)
    pinned_s = pinned_copy_s = math.nan
    if dev.type == "cuda" and all(kv.keys.device.type == "cpu" for kv in decoded):
        pinned = [
            ChunkKV(kv.keys.pin_memory(), kv.values.pin_memory(), kv.positions, kv.model_fingerprint) for kv in decoded
        ]
        pinned_feed = lambda: _feed(a, prefix, pinned, len(p.question))  # noqa: E731
        pinned_copy_s = _optional("pinned copy", lambda: _timed(pinned_feed, dev, repeats))[0]
        pinned_s = _optional(
            "from pinned host", lambda: _timed(lambda: _fused(a, prefix, pinned, p, config), dev, repeats)
        )[0]
        del pinned
    tier = [codec.decode(b, expect=None, device=dev, dtype=a.dtype) for b in blobs]  # the device tier's entries
    tier_s, tier_peak, ctx = _timed(lambda: _fused(a, prefix, tier, p, config), dev, repeats)
    tier_fused = lambda: _fused(a, prefix, tier, p, config)  # noqa: E731
    attention: dict[str, float] = {}  # the recompute's attention through SDPA with its masks, or the kernel
    for setting, name in (("0", "SDPA attention"), ("1", "attention kernel")):
        with mock.patch.dict(os.environ, {ATTENTION_ENV: setting}):
            if setting == "1" and attention_kernel(a) is None:  # its check failed: the column would time SDPA
                attention[setting] = math.nan
                continue
            attention[setting] = _optional(f"device tier, {name}", lambda: _timed(tier_fused, dev, repeats))[0]
    place_s, _, feed = _timed(lambda: _feed(a, prefix, tier, len(p.question)), dev, repeats)
    with mock.patch.dict(os.environ, {"RAGKV_TRITON": "0"}):  # keys turned through torch, not ragkv's kernel
        place_torch_s = extra(
            "place, torch", lambda: _timed(lambda: _feed(a, prefix, tier, len(p.question)), dev, repeats)
        )[0]
    probe_s, _, _ = _timed(lambda: _probe(a, feed, p), dev, repeats)  # CUDA graphs where they run
    with mock.patch.dict(os.environ, {"RAGKV_TRITON": "0"}):  # its scores scaled and masked through torch
        probe_torch_s = extra("probe, torch", lambda: _timed(lambda: _probe(a, feed, p), dev, repeats))[0]
    with mock.patch.dict(os.environ, {"RAGKV_PROBE_GRAPHS": "0"}):  # transformers' eager layers
        probe_eager_s = extra("probe eager", lambda: _timed(lambda: _probe(a, feed, p), dev, repeats))[0]
        with mock.patch.dict(os.environ, {"RAGKV_RECOMPUTE_GRAPHS": "0"}):  # the whole fusion eager
            fn = lambda: _fused(a, prefix, tier, p, config)  # noqa: E731
            tier_eager_s = extra("device tier eager", lambda: _timed(fn, dev, repeats))[0]

    # the masks made whole up front, as before ragkv.model.masks: time and peak against the blocks
    with mock.patch.object(ModelAdapter, "position_mask", whole_mask):
        fn = lambda: _fused(a, prefix, tier, p, config)  # noqa: E731
        whole_s, whole_peak, _ = extra("whole masks", lambda: _timed(fn, dev, repeats))
    kv_bytes = sum(kv.keys.numel() + kv.values.numel() for kv in tier) * tier[0].keys.element_size()
    tokens = len(p.prefix) + sum(len(c) for c in p.chunks) + len(p.question)
    recomputed = config.ratio * sum(len(c) for c in p.chunks) + len(p.question)
    linear = sum(m.numel() for name, m in a.model.named_parameters() if "layers." in name and m.dim() == 2)
    s = a.spec
    attn_flops = 4 * s.num_layers * a.model.config.num_attention_heads * s.head_dim * recomputed * tokens
    # the work the default method does: its focus share and the check layers run more than 15%
    # through the early layers (each pass = one token through one layer, attending the context)
    passes = ctx.token_passes
    heads = a.model.config.num_attention_heads
    work_flops = 2 * linear / s.num_layers * passes + 4 * heads * s.head_dim * passes * tokens
    weight_bytes = sum(m.numel() * m.element_size() for m in a.model.parameters())
    return {
        "tokens": tokens,
        "chunks": len(p.chunks),
        "full_ms": full_s * 1e3,
        "host_ms": host_s * 1e3,
        "host_speedup": full_s / host_s,
        "host_threads_ms": host_threads_s * 1e3,
        "host_int8_ms": int8_s * 1e3,
        "host_int8_speedup": full_s / int8_s,
        "tier_ms": tier_s * 1e3,
        "tier_speedup": full_s / tier_s,
        "attention_kernel": "yes" if attention_kernel(a) is not None else "no",
        "tier_sdpa_attention_ms": attention["0"] * 1e3,
        "tier_attention_kernel_ms": attention["1"] * 1e3,
        "decode_ms": decode_s * 1e3,
        "copy_ms": copy_s * 1e3,
        "copy_gb_s": kv_bytes / copy_s / 1e9,
        "slab_gb_s": _stored_bytes(decoded) / slab_s / 1e9 if _stored_bytes(decoded) else math.nan,
        "slab_threads_gb_s": _stored_bytes(decoded) / slab_threads_s / 1e9 if _stored_bytes(decoded) else math.nan,
        "pinned_ms": pinned_s * 1e3,
        "pinned_speedup": full_s / pinned_s,
        "pinned_copy_gb_s": kv_bytes / pinned_copy_s / 1e9,
        "place_ms": place_s * 1e3,
        "place_torch_ms": place_torch_s * 1e3,
        "probe_torch_ms": probe_torch_s * 1e3,
        "probe_ms": probe_s * 1e3,
        "probe_eager_ms": probe_eager_s * 1e3,
        "probe_bound_ms": weight_bytes / rates[0] * 1e3,
        "recompute_ms": max(tier_s - place_s - probe_s, 0.0) * 1e3,
        "tier_eager_ms": tier_eager_s * 1e3,
        "recompute_eager_ms": max(tier_eager_s - place_s - probe_eager_s, 0.0) * 1e3,
        "tier_whole_mask_ms": whole_s * 1e3,
        "tier_whole_mask_peak_gib": whole_peak / 2**30,
        "recompute_bound_ms": (2 * linear * recomputed + attn_flops) / rates[1] * 1e3,
        "token_passes": passes,
        "recompute_work_bound_ms": work_flops / rates[1] * 1e3,
        "full_peak_gib": full_peak / 2**30,
        "host_peak_gib": host_peak / 2**30,
        "tier_peak_gib": tier_peak / 2**30,
        "tier_gib": kv_bytes / 2**30,
        "kl": _kl(full, fused_logits),
    }


COLUMNS = (
    Column("tokens", "prompt tokens", "{:,}"),
    Column("chunks"),
    Column("full_ms", "full prefill ms", "{:,.0f}"),
    Column("host_ms", "fused from host ms", "{:,.0f}"),
    Column("host_speedup", "vs full", "{:.1f}x"),
    Column("host_threads_ms", "from host, staging on threads ms", "{:,.0f}"),
    Column("host_int8_ms", "from host, int8 ms", "{:,.0f}"),
    Column("host_int8_speedup", "vs full", "{:.1f}x"),
    Column("tier_ms", "fused from device tier ms", "{:,.0f}"),
    Column("tier_speedup", "vs full", "{:.1f}x"),
    Column("attention_kernel", "attention kernel"),
    Column("tier_sdpa_attention_ms", "device tier, SDPA attention ms", "{:,.0f}"),
    Column("tier_attention_kernel_ms", "device tier, attention kernel ms", "{:,.0f}"),
    Column("decode_ms", "decode from host ms", "{:,.0f}"),
    Column("copy_ms", "copy+place from host ms", "{:,.0f}"),
    Column("copy_gb_s", "copy GB/s", "{:.1f}"),
    Column("slab_gb_s", "host slab GB/s", "{:.1f}"),
    Column("slab_threads_gb_s", "host slab on threads GB/s", "{:.1f}"),
    Column("pinned_ms", "fused from pinned host ms", "{:,.0f}"),
    Column("pinned_speedup", "vs full", "{:.1f}x"),
    Column("pinned_copy_gb_s", "pinned copy GB/s", "{:.1f}"),
    Column("place_ms", "place ms", "{:,.1f}"),
    Column("place_torch_ms", "place, torch ms", "{:,.1f}"),
    Column("probe_ms", "probe ms", "{:,.1f}"),
    Column("probe_torch_ms", "probe, torch ms", "{:,.1f}"),
    Column("probe_eager_ms", "probe eager ms", "{:,.1f}"),
    Column("probe_bound_ms", "probe bound ms", "{:,.1f}"),
    Column("recompute_ms", "recompute ms", "{:,.0f}"),
    Column("tier_eager_ms", "device tier eager ms", "{:,.0f}"),
    Column("recompute_eager_ms", "recompute eager ms", "{:,.0f}"),
    Column("tier_whole_mask_ms", "device tier, whole masks ms", "{:,.0f}"),
    Column("recompute_bound_ms", "recompute bound ms", "{:,.0f}"),
    Column("recompute_work_bound_ms", "work bound ms", "{:,.0f}"),
    Column("full_peak_gib", "peak GiB full", "{:.1f}"),
    Column("tier_peak_gib", "peak GiB fused (tier)", "{:.1f}"),
    Column("tier_whole_mask_peak_gib", "peak GiB, whole masks", "{:.1f}"),
    Column("tier_gib", "tier GiB", "{:.2f}"),
    Column("graphs_gib", "graphs GiB", "{:.2f}"),
    Column("kl", "KL fused vs full", "{:.4f}"),
)


_INT8 = CodecSpec("int8", 0)


def _codec_spec(text: str) -> tuple[str, int]:
    name, _, level = text.partition(":")
    return name, int(level or 0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ragkv bench gpu", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--contexts", default=None, help="prompt lengths in tokens (default 4096,16384,32768)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default 512; 64 with --tiny)")
    ap.add_argument(
        "--codec",
        default="raw:0",
        help="codec:level the chunks are stored with (host rows; the int8 column is NaN when this is int8:0)",
    )
    ap.add_argument("--method", default="query_focus", help="fusion method")
    ap.add_argument("--ratio", type=float, default=0.15, help="share of chunk tokens recomputed")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config, on the CPU when there is no GPU")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (and the device) here")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds after which the comparison columns (int8, staging on threads, the torch, eager and "
        "whole-mask variants) are skipped, NaN, so that a time-limited run still measures every row's main "
        "columns (default: no limit)",
    )
    args = ap.parse_args(argv)
    if args.budget_s is not None and not args.budget_s >= 0:
        ap.error(f"--budget-s must be >= 0 seconds; got {args.budget_s}")
    args.contexts = args.contexts or ("512,1024" if args.tiny else "4096,16384,32768")
    args.chunk = args.chunk or (64 if args.tiny else 512)
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print its table, return its rows."""
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit(
            "ragkv bench gpu needs a CUDA device and torch sees none; "
            "run it where a GPU is lent, or pass --tiny for a CPU smoke run of the same code"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not logging.getLogger().handlers:  # the GPU data path's choices (kernels kept or not, timings) on stderr
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("ragkv.gpu").setLevel(logging.INFO)
    a = build_model(TINY if args.tiny else LLAMA_3_1_8B, device, dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    weights = sum(p.numel() * p.element_size() for p in a.model.parameters()) / 2**30
    head = (
        f"{'tiny' if args.tiny else 'Llama-3.1-8B shape'}, random weights, {dtype} on {name}; "
        f"weights {weights:.1f} GiB; chunks of {args.chunk} stored as {args.codec}; "
        f"{args.method} at {args.ratio:.0%}; best of {args.repeats}; torch {torch.__version__}; "
        f"{torch.get_num_threads()} torch threads, {default_workers(device.type)} decode threads, "
        f"{_split_threads(device)} staging threads where staging is split"
    )
    print(head, flush=True)

    def save(rows: list[dict[str, Any]]) -> None:
        if args.json is not None:
            args.json.write_text(json.dumps({"device": name, "setup": head, "rows": rows}, indent=1) + "\n")

    def measured(rows: list[dict[str, Any]]) -> None:
        # each row as soon as it is measured: a run stopped by its time limit keeps what it measured
        print("row: " + json.dumps(rows[-1]), flush=True)
        save(rows)

    rows = sorted(measure(a, contexts, args, measured), key=lambda r: r["tokens"])  # the table by length
    save(rows)
    print(format_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
