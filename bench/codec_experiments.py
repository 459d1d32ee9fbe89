"""Codec ideas measured and not adopted (docs/benchmarks.md, codec section): bytes and KL only.

    python bench/codec_experiments.py prerope      # keys coded before RoPE (re-rotated to position 0)
    python bench/codec_experiments.py entropy      # zstd frames vs order-0 entropy of the symbols
    python bench/codec_experiments.py outliers     # the worst-coded 1-3% of tokens stored exactly
    python bench/codec_experiments.py sensitivity  # level 2 with one layer's step doubled at a time

All use the first built-in prompts of ``ragkv bench codec`` on the default model and score the
question and the exact cache's greedy answer (KL(exact || decoded), as the codec bench does).
Nothing here is timed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence

import numpy as np
import torch

import ragkv.codec.cachegen as cachegen
from ragkv.bench.codec import _Case, _kl, _prepare
from ragkv.bench.prompt_sets import prompt_set
from ragkv.codec import Expected, decode, encode
from ragkv.model import ModelAdapter, load_model
from ragkv.types import ChunkKV, CodecSpec, StorageKey, tenant_namespace

FP16_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes


_KEY = StorageKey(f"{tenant_namespace('ragkv-bench')}/codec-experiments")


def _roundtrip(kv: ChunkKV, level: int) -> tuple[ChunkKV, int]:
    """``kv`` through cachegen at ``level``: (decoded kv, encoded bytes)."""
    spec = CodecSpec("cachegen", level)
    data = encode(kv, spec, key=_KEY).data
    return decode(data, expect=Expected.of(kv, spec, _KEY)), len(data)


def _score(
    adapter: ModelAdapter, cases: Sequence[_Case], code: Callable[[ChunkKV], tuple[ChunkKV, int]]
) -> tuple[float, float]:
    """(bytes per token, mean KL) when every slice goes through ``code`` (-> decoded kv, bytes)."""
    nbytes = tokens = 0
    kls = []
    for case in cases:
        decoded = []
        for kv in case.slices:
            out, size = code(kv)
            decoded.append(out)
            nbytes += size
            tokens += kv.num_tokens
        kls.append(_kl(case.logits, adapter.suffix_logits(decoded, case.suffix, case.answer)))
    return nbytes / tokens, float(torch.cat(kls).mean())


def prerope(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    for level in (0, 1, 2, 3):
        for mode in ("post", "pre"):

            def code(kv: ChunkKV, level: int = level, mode: str = mode) -> tuple[ChunkKV, int]:
                zero = torch.zeros(kv.num_tokens, dtype=torch.long)
                src = adapter.rerotate(kv, zero) if mode == "pre" else kv
                out, size = _roundtrip(src, level)
                return (adapter.rerotate(out, kv.positions) if mode == "pre" else out), size

            size, kl = _score(adapter, cases, code)
            print(f"level {level} keys {mode}-RoPE: {size:.0f} bytes/token, KL {kl:.4f}", flush=True)


def _entropy_bytes(symbols: np.ndarray) -> float:
    _, counts = np.unique(symbols, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum()) / 8


def entropy(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    for level in (1, 2):
        schedule = cachegen.LEVELS[level]
        total = {"zstd": 0.0, "per-layer order-0": 0.0, "per-channel order-0": 0.0}
        for case in cases:
            for kv in case.slices[1:]:
                kinds = ((kv.keys, schedule.key_steps, True), (kv.values, schedule.value_steps, False))
                for x, steps, per_layer in kinds:
                    n = x.shape[0]
                    rel = torch.tensor([steps[schedule.group(i, n)] for i in range(n)]).view(-1, 1, 1, 1)
                    _, _, q = cachegen._quantize(x[:, :, 1:].float(), rel, per_layer)
                    total["zstd"] += sum(map(len, cachegen._code_streams(q, 0)[0]))
                    sym = q.numpy()
                    for layer in range(n):
                        total["per-layer order-0"] += _entropy_bytes(sym[layer])
                        for h in range(sym.shape[1]):
                            for d in range(sym.shape[3]):
                                total["per-channel order-0"] += _entropy_bytes(sym[layer, h, :, d])
        print(f"level {level}:", {k: round(v / total["zstd"], 3) for k, v in total.items()}, flush=True)


def outliers(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    for level in (1, 2):
        for share in (0.0, 0.01, 0.03):

            def code(kv: ChunkKV, level: int = level, share: float = share) -> tuple[ChunkKV, int]:
                out, size = _roundtrip(kv, level)
                k = round(share * kv.num_tokens)
                if not k:
                    return out, size
                err = torch.stack(  # [tokens] relative error of keys plus that of values
                    [
                        (got - want).float().pow(2).sum((0, 1, 3)) / want.float().pow(2).sum((0, 1, 3))
                        for got, want in ((out.keys, kv.keys), (out.values, kv.values))
                    ]
                ).sum(0)
                idx = torch.topk(err, k).indices
                keys, values = out.keys.clone(), out.values.clone()
                keys[:, :, idx], values[:, :, idx] = kv.keys[:, :, idx], kv.values[:, :, idx]
                exact = ChunkKV(keys, values, kv.positions, kv.model_fingerprint)
                return exact, size + k * FP16_BYTES_PER_TOKEN

            size, kl = _score(adapter, cases, code)
            print(f"level {level}, worst {share:.0%} of tokens exact: {size:.0f} bytes/token, KL {kl:.4f}", flush=True)


def sensitivity(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    base = cachegen.LEVELS[2]
    n = adapter.spec.num_layers
    k0 = [base.key_steps[base.group(i, n)] for i in range(n)]
    v0 = [base.value_steps[base.group(i, n)] for i in range(n)]

    def run(k: list[float], v: list[float]) -> tuple[float, float]:
        # a per-layer schedule, duck-typed as a StepSchedule whose "groups" are the layers
        schedule = types.SimpleNamespace(key_steps=k, value_steps=v, zstd_level=0, group=lambda i, _n: i)
        cachegen.LEVELS[2] = schedule  # type: ignore[assignment]
        try:
            return _score(adapter, cases, lambda kv: _roundtrip(kv, 2))
        finally:
            cachegen.LEVELS[2] = base

    size0, kl0 = run(k0, v0)
    print(f"level 2: {size0:.0f} bytes/token, KL {kl0:.4f}", flush=True)
    for kind in ("k", "v"):
        for layer in range(n):
            k, v = list(k0), list(v0)
            (k if kind == "k" else v)[layer] *= 2
            size, kl = run(k, v)
            print(f"{kind}{layer} step x2: saves {size0 - size:.1f} bytes/token, KL {kl - kl0:+.5f}", flush=True)


EXPERIMENTS = {  # name -> (function, built-in prompts used)
    "prerope": (prerope, 4),
    "entropy": (entropy, 3),
    "outliers": (outliers, 4),
    "sensitivity": (sensitivity, 3),
}


@torch.inference_mode()
def main(argv: list[str]) -> None:
    name = "builtin"
    if argv[1:2] == ["--prompts"] and len(argv) == 3:
        name, argv = argv[2], argv[:1]
    if len(argv) != 1 or argv[0] not in EXPERIMENTS:
        raise SystemExit(
            f"usage: python bench/codec_experiments.py {{{','.join(EXPERIMENTS)}}} [--prompts builtin|packages]"
        )
    run, prompts = EXPERIMENTS[argv[0]]
    adapter = load_model("smollm2-135m")
    answer_tokens = 4 if argv[0] == "entropy" else 16 if argv[0] == "sensitivity" else 24
    cases = [_prepare(adapter, p, answer_tokens) for p in prompt_set(name, adapter, n=prompts)]
    run(adapter, cases)


if __name__ == "__main__":
    main(sys.argv[1:])
