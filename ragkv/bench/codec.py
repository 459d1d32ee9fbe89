"""Codec benchmark: bytes, fidelity and speed of every codec and level on real prompts.

For each prompt the exact context KV (prefix + all chunks, one prefill) is sliced per segment;
each slice is encoded and decoded on its own, as stored chunks are; the question and the exact
cache's greedy answer are then scored on top of the decoded slices against the exact cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ragkv.bench import table
from ragkv.bench.table import Column
from ragkv.codec import Expected, available_codecs, cachegen, decode, encode
from ragkv.codec.calibrate import calibrate, step_scales
from ragkv.codec.saliency import normalized_attention
from ragkv.codec.transform import ChannelTransform
from ragkv.generation import Decoder, generate_ids
from ragkv.model import AttentionProbe, ModelAdapter
from ragkv.retriever.transforms import rope_frequencies  # the one indexing calibrates with
from ragkv.types import ChunkKV, CodecSpec, StorageKey, tenant_namespace

__all__ = [
    "ROW_KEYS",
    "TABLE",
    "calibrate_transform",
    "measure_sensitivity",
    "run_codec_bench",
    "format_table",
    "rope_frequencies",
]

ROW_KEYS = (
    "codec",
    "level",
    "bytes_per_token",
    "ratio_vs_fp16",
    "ratio_vs_int8",
    "kl",
    "top1",
    "answer_match",
    "encode_mbps",
    "decode_mbps",
)
_BASELINE = ("int8", 0)  # ratio_vs_int8 is measured against this, in the same run
_BENCH_KEY = StorageKey(f"{tenant_namespace('ragkv-bench')}/codec-bench")  # every blob names a key


class _Adapter(Decoder, Protocol):
    def chat_segments(
        self, system: str, chunks: list[str], question: str
    ) -> tuple[list[int], list[list[int]], list[int]]: ...

    def prefill_kv(self, token_ids: Sequence[int], past: Sequence[ChunkKV] = ()) -> ChunkKV: ...

    def suffix_logits(
        self, context: Sequence[ChunkKV], suffix_ids: Sequence[int], answer_ids: Sequence[int] = ()
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class _Case:
    """One prompt's exact reference."""

    slices: tuple[ChunkKV, ...]  # prefix and chunk KV, sliced from one exact prefill
    saliency: tuple[torch.Tensor | None, ...]  # per slice: normalized attention its tokens received there
    suffix: tuple[int, ...]  # question + generation prompt ids
    answer: tuple[int, ...]  # greedy answer on the exact cache
    logits: torch.Tensor  # [len(suffix) + len(answer), vocab] on the exact cache


def _prepare(adapter: _Adapter, prompt: Mapping[str, Any], answer_tokens: int) -> _Case:
    prefix, chunks, suffix = adapter.chat_segments(prompt["system"], list(prompt["chunks"]), prompt["question"])
    segments = [seg for seg in (prefix, *chunks) if seg]
    ids = [t for seg in segments for t in seg]
    bounds = [0]
    for seg in segments:
        bounds.append(bounds[-1] + len(seg))
    if not isinstance(adapter, ModelAdapter):  # a stand-in adapter without a probe: the codec falls back to its proxy
        kv = adapter.prefill_kv(ids)
        saliency: tuple[torch.Tensor | None, ...] = (None,) * len(segments)
    else:
        probe = AttentionProbe(None)
        kv = adapter.prefill_kv(ids, probe=probe)
        # each slice's tokens as the index path sees them: the attention they receive from the
        # queries of their own chunk and of the later ones, per query that sees them
        saliency = tuple(
            normalized_attention({i: w[a:] for i, w in probe.weights.items()}, kv.num_tokens - a)[: b - a]
            for a, b in zip(bounds, bounds[1:], strict=False)
        )
    slices = tuple(kv.slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False))
    answer = generate_ids(adapter, [kv], suffix, answer_tokens)
    logits = adapter.suffix_logits([kv], suffix, answer)
    return _Case(slices=slices, saliency=saliency, suffix=tuple(suffix), answer=tuple(answer), logits=logits.float())


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per position, from logits ``[positions, vocab]``."""
    log_p = torch.log_softmax(ref.float(), dim=-1)
    log_q = torch.log_softmax(got.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _measure(
    adapter: _Adapter,
    cases: Sequence[_Case],
    codec: str,
    level: int,
    answer_tokens: int,
    decode_repeats: int,
    quality: bool,
    transform: ChannelTransform | None = None,
) -> dict[str, Any]:
    spec = CodecSpec(codec, level)
    nbytes = tokens = elements = 0
    encode_s = decode_s = 0.0
    kls: list[torch.Tensor] = []
    top1: list[torch.Tensor] = []
    matches = 0
    for case in cases:
        decoded = []
        for kv, saliency in zip(case.slices, case.saliency, strict=True):
            start = time.perf_counter()
            data = encode(kv, spec, key=_BENCH_KEY, saliency=saliency, transform=transform).data
            encode_s += time.perf_counter() - start
            best = float("inf")
            expect = Expected.of(kv, spec, _BENCH_KEY)  # checked as the query path checks it
            for _ in range(decode_repeats):  # best of n: the machine may be shared
                start = time.perf_counter()
                out = decode(data, expect=expect, transform=transform)
                best = min(best, time.perf_counter() - start)
            decode_s += best
            decoded.append(out)
            nbytes += len(data)
            tokens += kv.num_tokens
            elements += 2 * kv.keys.numel()
        if quality:
            logits = adapter.suffix_logits(decoded, case.suffix, case.answer)
            kls.append(_kl(case.logits, logits))
            top1.append((logits.argmax(-1) == case.logits.argmax(-1)).float())
            answer = generate_ids(adapter, decoded, case.suffix, answer_tokens)
            matches += int(tuple(answer) == case.answer)
    fp16_mb = elements * 2 / 1e6
    return {
        "codec": codec if transform is None else f"{codec}+klt",
        "level": level,
        "bytes_per_token": nbytes / max(1, tokens),
        "ratio_vs_fp16": elements * 2 / max(1, nbytes),
        "ratio_vs_int8": 0.0,  # filled in once the baseline is known
        "kl": float(torch.cat(kls).mean()) if kls else float("nan"),
        "top1": float(torch.cat(top1).mean()) if top1 else float("nan"),
        "answer_match": matches / len(cases) if quality and cases else float("nan"),
        "encode_mbps": fp16_mb / encode_s if encode_s else float("inf"),
        "decode_mbps": fp16_mb / decode_s if decode_s else float("inf"),
    }


def run_codec_bench(
    adapter: Any,
    prompts: list[dict],
    codecs: dict[str, tuple[int, ...]] | None = None,
    answer_tokens: int = 24,
    decode_repeats: int = 3,
    transform: ChannelTransform | None = None,
) -> list[dict]:
    """Measure every codec and level on ``prompts``; one row per (codec, level).

    Args:
        adapter: a ``ragkv.model.ModelAdapter`` (or anything with its ``chat_segments``,
            ``prefill_kv``, ``suffix_logits``, ``build_cache``, ``forward`` and ``eos_token_ids``).
        prompts: dicts ``{"system": str, "chunks": [str, ...], "question": str}``.
        codecs: codec name -> levels to measure; default every registered codec and level.
        answer_tokens: length of the greedy answers that are compared.
        decode_repeats: decodes per slice; the fastest counts.
        transform: the model's channel transform: every ``cachegen`` level is measured with it
            too, in rows named ``cachegen+klt``.

    Returns:
        Rows with exactly the keys in ``ROW_KEYS``. ``kl`` is the mean KL(exact || decoded) over
        the question and answer positions; ``decode_mbps`` is fp16-equivalent MB/s (elements x 2
        bytes / seconds) of whole-chunk decodes to float32 tensors on CPU.
    """
    if not prompts:
        raise ValueError("run_codec_bench needs at least one prompt")
    codecs = dict(codecs) if codecs is not None else available_codecs()
    cases = [_prepare(adapter, p, answer_tokens) for p in prompts]
    rows = [
        _measure(adapter, cases, name, level, answer_tokens, decode_repeats, quality=True)
        for name, levels in codecs.items()
        for level in levels
    ]
    if transform is not None:
        rows += [
            _measure(adapter, cases, "cachegen", level, answer_tokens, decode_repeats, True, transform)
            for level in codecs.get("cachegen", ())
        ]
    baseline = next((r for r in rows if (r["codec"], r["level"]) == _BASELINE), None)
    if baseline is None:
        baseline = _measure(adapter, cases, *_BASELINE, answer_tokens, 1, quality=False)
    for row in rows:
        row["ratio_vs_int8"] = baseline["bytes_per_token"] / row["bytes_per_token"]
    return rows


def calibrate_transform(
    adapter: Any, prompts: Sequence[Mapping[str, Any]], level: int = 1, sensitivity: bool = True
) -> ChannelTransform:
    """The model's channel transform, calibrated on the chunks of ``prompts`` (one exact prefill each).

    With ``sensitivity``, each layer's steps are scaled by the model's measured sensitivity
    (:func:`measure_sensitivity`, :func:`ragkv.codec.calibrate.step_scales`).
    """
    cases = [_prepare(adapter, p, answer_tokens=16) for p in prompts]
    transform = calibrate([kv for case in cases for kv in case.slices], inv_freq=rope_frequencies(adapter), level=level)
    if sensitivity:
        transform = dataclasses.replace(transform, step_scales=step_scales(measure_sensitivity(adapter, cases, level)))
    return transform


def measure_sensitivity(adapter: _Adapter, cases: Sequence[_Case], level: int, noise: float = 2.0) -> list[list[float]]:
    """Per K/V and layer, the mean KL when only that layer's keys (values) are perturbed.

    The perturbation is uniform noise ``noise`` times the ``cachegen`` level's step there wide
    (what a step ``noise`` times coarser would add), on every slice but its first token; every
    other layer stays exact, so each number is that layer's own effect. Seeded: deterministic.
    """
    schedule = cachegen.LEVELS[level]
    gen = torch.Generator().manual_seed(0)
    num_layers = cases[0].slices[0].num_layers
    kl = [[0.0] * num_layers for _ in range(2)]
    for case in cases:
        for kind, per_layer in ((0, True), (1, False)):
            relative = schedule.key_steps if kind == 0 else schedule.value_steps
            for layer in range(num_layers):
                rel = relative[schedule.group(layer, num_layers)]
                noisy = [_perturbed(kv, kind, layer, rel * noise, per_layer, gen) for kv in case.slices]
                logits = adapter.suffix_logits(noisy, case.suffix, case.answer)
                kl[kind][layer] += float(_kl(case.logits, logits).mean()) / len(cases)
    return kl


def _perturbed(kv: ChunkKV, kind: int, layer: int, rel: float, per_layer: bool, gen: torch.Generator) -> ChunkKV:
    keys, values = kv.keys.float(), kv.values.float()
    if kv.num_tokens > 1:
        x = (keys if kind == 0 else values).clone()
        y = x[layer : layer + 1, :, 1:]  # [1, H, T-1, D]
        step = cachegen.channel_sigma(y, per_layer) * rel
        x[layer : layer + 1, :, 1:] = y + (torch.rand(y.shape, generator=gen) - 0.5) * step
        keys, values = (x, values) if kind == 0 else (keys, x)
    return ChunkKV(keys, values, kv.positions, kv.model_fingerprint)


TABLE = (
    Column("codec"),
    Column("level"),
    Column("bytes_per_token", "bytes/token", "{:,.0f}"),
    Column("ratio_vs_fp16", "vs fp16", "{:.2f}"),
    Column("ratio_vs_int8", "vs int8", "{:.2f}"),
    Column("kl", "mean KL", "{:.4f}"),
    Column("top1", "top-1", "{:.3f}"),
    Column("answer_match", "answers identical", "{:.2f}"),
    Column("encode_mbps", "encode MB/s", "{:,.0f}"),
    Column("decode_mbps", "decode MB/s", "{:,.0f}"),
)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The codec bench's rows as a Markdown table (:data:`TABLE`'s columns)."""
    return table.format_table(rows, TABLE)


def plot_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Bytes per token against mean KL, one point per (codec, level), log-scaled KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        kl = max(float(r["kl"]), 1e-6)
        ax.scatter(r["bytes_per_token"], kl)
        ax.annotate(f"{r['codec']} {r['level']}", (r["bytes_per_token"], kl), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token")
    ax.set_ylabel("mean KL(exact || decoded)")
    ax.set_title("ragkv codecs: size vs fidelity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
