"""The GPU path at Llama-3.1-8B's shape: full prefill against fused TTFT, peak memory, codec decode rate.

    python experiments/gpu_llama8b.py [--contexts 4096,16384,32768] [--chunk 512] [--codec cachegen:0]
                                [--method query_focus] [--ratio 0.15] [--repeats 3]
    python experiments/gpu_llama8b.py --tiny          # a CPU smoke run of the same code on a tiny config

A random-weight model of Llama-3.1-8B's shape (32 layers, 32 query and 8 KV heads of 128 dims,
llama3 RoPE scaling, a 128K vocabulary) is built on the GPU in bf16: no download; the weights do
not matter for time or memory. For each context length the prompt is a 16-token prefix, chunks of
``--chunk`` random tokens, and a 32-token question. Each chunk's cache is prefilled after the
prefix and encoded once, before any timing, as at index time (the chunks are shared by the
context lengths: the 4K prompt is the first chunks of the 32K one).

Timed, best of ``--repeats`` after one warm-up, with the device synchronized around each run:

- full prefill: the whole prompt through the model from an empty cache (last position's logits);
- fused TTFT: every chunk's bytes decoded onto the GPU, then fusion with the question riding
  along (``prefill_suffix``): the first token's logits, as ``RagKV.answer`` gets them;
- fuse only: the same fusion with the chunk caches already on the GPU (TTFT minus decode);
- decode: the codec decode of every chunk onto the GPU, in GB/s of bf16 KV produced and MB/s of
  stored bytes read.

Peak memory is ``torch.cuda.max_memory_allocated`` during each run, weights included (they are
listed once). KL is the first answer token's distribution, fused against full prefill (a random
model: a check that fusion ran, not a quality figure). Without CUDA the script refuses, unless
``--tiny``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragkv import codec
from ragkv.bench.table import Column, format_table
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from ragkv.model.caches import cache_kwarg
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


def _fused(a: ModelAdapter, prefix: ChunkKV, chunks: list[ChunkKV], p: _Prompt, config: FusionConfig) -> torch.Tensor:
    fused = fuse(a, FusionInput(prefix, chunks, p.chunks, p.question), config, prefill_suffix=True)
    assert fused.suffix_logits is not None  # prefill_suffix always fills it
    return fused.suffix_logits[-1]


def _decode_all(blobs: Sequence[bytes], a: ModelAdapter) -> list[ChunkKV]:
    return [codec.decode(b, expect=None, device=a.device, dtype=a.dtype) for b in blobs]


def measure(a: ModelAdapter, contexts: Sequence[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One table row per context length (see the module docstring)."""
    spec = CodecSpec(*_codec_spec(args.codec))
    longest = _prompt(a.spec.vocab_size, max(contexts), args.chunk)
    prefix = a.prefill_kv(longest.prefix)
    blobs = [codec.encode(a.prefill_kv(c, past=[prefix]), spec, key=_KEY).data for c in longest.chunks]
    rows = []
    for context in contexts:
        n = len(_prompt(a.spec.vocab_size, context, args.chunk).chunks)
        p = _Prompt(longest.prefix, longest.chunks[:n], longest.question)
        rows.append(_row(a, prefix, p, blobs[:n], FusionConfig(method=args.method, ratio=args.ratio), args.repeats))
    return rows


def _row(
    a: ModelAdapter, prefix: ChunkKV, p: _Prompt, blobs: Sequence[bytes], config: FusionConfig, repeats: int
) -> dict[str, Any]:
    """The measurements of one prompt whose chunks are stored as ``blobs``."""
    full_s, full_peak, full = _timed(lambda: _full_prefill(a, p), a.device, repeats)
    ttft_s, ttft_peak, fused = _timed(lambda: _fused(a, prefix, _decode_all(blobs, a), p, config), a.device, repeats)
    on_device = _decode_all(blobs, a)
    fuse_s, _, _ = _timed(lambda: _fused(a, prefix, on_device, p, config), a.device, repeats)
    decode_s, _, _ = _timed(lambda: _decode_all(blobs, a), a.device, repeats)
    kv_bytes = sum(kv.keys.numel() + kv.values.numel() for kv in on_device) * on_device[0].keys.element_size()
    return {
        "tokens": len(p.prefix) + sum(len(c) for c in p.chunks) + len(p.question),
        "chunks": len(p.chunks),
        "full_ms": full_s * 1e3,
        "ttft_ms": ttft_s * 1e3,
        "speedup": full_s / ttft_s,
        "fuse_ms": fuse_s * 1e3,
        "decode_gb_s": kv_bytes / decode_s / 1e9,
        "stored_mb_s": sum(len(b) for b in blobs) / decode_s / 1e6,
        "full_peak_gib": full_peak / 2**30,
        "ttft_peak_gib": ttft_peak / 2**30,
        "kl": _kl(full, fused),
    }


COLUMNS = (
    Column("tokens", "prompt tokens", "{:,}"),
    Column("chunks"),
    Column("full_ms", "full prefill ms", "{:,.0f}"),
    Column("ttft_ms", "fused TTFT ms", "{:,.0f}"),
    Column("speedup", "speedup", "{:.1f}x"),
    Column("fuse_ms", "fuse only ms", "{:,.0f}"),
    Column("decode_gb_s", "decode GB/s (KV out)", "{:.2f}"),
    Column("stored_mb_s", "decode MB/s (stored in)", "{:,.0f}"),
    Column("full_peak_gib", "peak GiB full", "{:.1f}"),
    Column("ttft_peak_gib", "peak GiB fused", "{:.1f}"),
    Column("kl", "KL fused vs full", "{:.4f}"),
)


def _codec_spec(text: str) -> tuple[str, int]:
    name, _, level = text.partition(":")
    return name, int(level or 0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--contexts", default=None, help="prompt lengths in tokens (default 4096,16384,32768)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default 512; 64 with --tiny)")
    ap.add_argument("--codec", default="cachegen:0", help="codec:level the chunks are stored with")
    ap.add_argument("--method", default="query_focus", help="fusion method")
    ap.add_argument("--ratio", type=float, default=0.15, help="share of chunk tokens recomputed")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config, on the CPU when there is no GPU")
    args = ap.parse_args(argv)
    args.contexts = args.contexts or ("512,1024" if args.tiny else "4096,16384,32768")
    args.chunk = args.chunk or (64 if args.tiny else 512)
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print its table, return its rows."""
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit(
            "experiments/gpu_llama8b.py needs a CUDA device and torch sees none; "
            "run it where a GPU is lent, or pass --tiny for a CPU smoke run of the same code"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = build_model(TINY if args.tiny else LLAMA_3_1_8B, device, dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    weights = sum(p.numel() * p.element_size() for p in a.model.parameters()) / 2**30
    print(
        f"{'tiny' if args.tiny else 'Llama-3.1-8B shape'}, random weights, {dtype} on {name}; "
        f"weights {weights:.1f} GiB; chunks of {args.chunk} stored as {args.codec}; "
        f"{args.method} at {args.ratio:.0%}; best of {args.repeats}"
    )
    rows = measure(a, contexts, args)
    print(format_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
