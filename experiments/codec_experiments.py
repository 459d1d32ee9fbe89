"""Codec ideas measured and not adopted (docs/benchmarks.md, codec section): bytes and KL only.

    python experiments/codec_experiments.py prerope      # keys coded before RoPE (re-rotated to position 0)
    python experiments/codec_experiments.py entropy      # zstd frames vs order-0 entropy of the symbols
    python experiments/codec_experiments.py outliers     # the worst-coded 1-3% of tokens stored exactly
    python experiments/codec_experiments.py sensitivity  # level 2 with one layer's step doubled at a time
    python experiments/codec_experiments.py klt --prompts packages  # PCA per layer/head, calibrated on builtin
    python experiments/codec_experiments.py klt_cost     # timed: decode speed with the inverse transform

All use the first built-in prompts of ``ragkv bench codec`` on the default model and score the
question and the exact cache's greedy answer (KL(exact || decoded), as the codec bench does).
Nothing here is timed but ``klt_cost`` (run it on a quiet machine).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard as zstd

import ragkv.codec.cachegen as cachegen
from ragkv.bench.codec import _Case, _kl, _prepare
from ragkv.bench.fusion import builtin_prompts
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
                    y = x[:, :, 1:].float()
                    _, _, q = cachegen.quantize(y, cachegen.channel_sigma(y, per_layer) * rel)
                    total["zstd"] += sum(map(len, cachegen.code_streams(q, 0)[0]))
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


# --- klt: a per-model channel transform (PCA of keys and of values, per layer and KV head) ---
#
# Calibrated once on chunks of built-in prompts 4-7 (never scored); coding happens in the
# transformed space with cachegen's own stages (1/8-octave step codes, integer means, the
# smallest zstd layout per (K/V, layer) stream); the first token stays fp16 as in cachegen.
# Bytes exclude the 30-byte-odd blob header (the same for every variant) and the transform
# itself (stored once per model: 2 x L x H x (D x D + D) floats, 2.9 MB for SmolLM2-135M).


@dataclass(frozen=True)
class _Klt:
    """Per-(K/V, layer, head) centring and orthonormal basis, variance descending."""

    mean: torch.Tensor  # [2, L, H, 1, D]
    basis: torch.Tensor  # [2, L, H, D, D]; columns are the principal directions
    pre_rope: bool  # keys are rotated to position 0 before the transform (and back after)


def _unrotated(adapter: ModelAdapter, kv: ChunkKV) -> ChunkKV:
    return adapter.rerotate(kv, torch.zeros(kv.num_tokens, dtype=torch.long))


def _calibrate(adapter: ModelAdapter, slices: Sequence[ChunkKV], pre_rope: bool) -> _Klt:
    parts: list[list[torch.Tensor]] = [[], []]
    for kv in slices:
        kv = _unrotated(adapter, kv) if pre_rope else kv
        parts[0].append(kv.keys[:, :, 1:].double())  # the first token is stored exactly anyway
        parts[1].append(kv.values[:, :, 1:].double())
    means, bases = [], []
    for chunks in parts:
        x = torch.cat(chunks, dim=2)  # [L, H, N, D]
        mean = x.mean(dim=2, keepdim=True)
        centred = x - mean
        cov = centred.transpose(2, 3) @ centred / x.shape[2]  # [L, H, D, D]
        _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
        means.append(mean.float())
        bases.append(vectors.flip(-1).float())
    return _Klt(torch.stack(means), torch.stack(bases), pre_rope)


def _code_plane(y: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``y`` ``[L, H, N, D]`` quantized at about ``step`` (broadcast to ``[L, H, 1, D]``), coded.

    Returns the dequantized ``y`` and the bytes of its tables and streams.
    """
    target = torch.log2(step.expand(*y.shape[:2], 1, y.shape[3])) * 8 + 128
    code = target.round().clamp(0, 255).to(torch.int32)
    step = cachegen.step_value(code)
    mean = torch.round(y.mean(dim=2, keepdim=True) / step)
    q = torch.round(y / step) - mean
    if float(q.abs().max()) > 32767 or float(mean.abs().max()) > 32767:
        raise ValueError("step too small for int16 symbols")
    frames, _ = cachegen.code_streams(q.to(torch.int16), 0)
    tables = code.to(torch.uint8).numpy().tobytes() + mean.to(torch.int16).numpy().tobytes()
    return (q + mean) * step, sum(map(len, frames)) + len(zstd.ZstdCompressor(level=19).compress(tables))


def _steps(x: torch.Tensor, rel: torch.Tensor, per_layer: bool) -> torch.Tensor:
    """cachegen's steps for ``x`` ``[L, H, N, D]``: sigma x ``rel`` ``[L, 1, 1, 1]``, ``[L, H, 1, D]``."""
    sigma = x.std(dim=2, correction=0, keepdim=True).clamp_min(1e-6)
    if per_layer:
        sigma = torch.exp(torch.log(sigma).mean(dim=(1, 3), keepdim=True)).expand_as(sigma)
    return sigma * rel


def _klt_code(
    adapter: ModelAdapter, kv: ChunkKV, level: int, klt: _Klt | None, scale: float = 1.0
) -> tuple[ChunkKV, int]:
    """``kv`` coded at cachegen ``level``'s steps (times ``scale``), in ``klt``'s space if given.

    Without a transform this is cachegen (keys: one step per layer; values: one per channel).
    With one, every component of a (layer, head) gets the same step: the geometric mean of the
    steps cachegen would give that head's channels (so the mean squared error stays about the
    same, the transform being orthonormal) and the bytes show what the decorrelation saves.
    """
    if kv.num_tokens < 2:
        return kv, 2 * kv.keys.numel() * 2
    schedule = cachegen.LEVELS[level]
    src = _unrotated(adapter, kv) if klt is not None and klt.pre_rope else kv
    n = kv.num_layers
    out, nbytes = [], 2 * 2 * kv.keys[:, :, :1].numel()  # fp16 first token, keys and values
    for i, (x, rel_steps, per_layer) in enumerate(
        ((src.keys, schedule.key_steps, True), (src.values, schedule.value_steps, False))
    ):
        x = x.float()
        rel = torch.tensor([rel_steps[schedule.group(j, n)] for j in range(n)]).view(-1, 1, 1, 1) * scale
        step = _steps(x[:, :, 1:], rel, per_layer)
        if klt is None:
            y_hat, size = _code_plane(x[:, :, 1:], step)
        else:
            head_step = torch.exp(torch.log(step).mean(dim=3, keepdim=True))  # [L, H, 1, 1]
            z = (x[:, :, 1:] - klt.mean[i]) @ klt.basis[i]
            z_hat, size = _code_plane(z, head_step)
            y_hat = z_hat @ klt.basis[i].transpose(2, 3) + klt.mean[i]
        out.append(torch.cat([x[:, :, :1].half().float(), y_hat], dim=2))
        nbytes += size
    decoded = ChunkKV(out[0], out[1], src.positions, kv.model_fingerprint)
    if klt is not None and klt.pre_rope:
        decoded = adapter.rerotate(decoded, kv.positions)
    return decoded, nbytes


def klt(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    calibration = []
    for p in builtin_prompts(adapter, n=8, max_tokens=2000)[4:]:  # held out from every scored set
        prefix, chunks, _ = adapter.chat_segments(None, p["chunks"], p["question"])
        pre = adapter.prefill_kv(prefix)
        calibration += [adapter.prefill_kv(c, past=[pre]) for c in chunks]
    print(f"calibrated on {sum(kv.num_tokens for kv in calibration)} tokens of built-in prompts 4-7", flush=True)
    transforms = {"post": _calibrate(adapter, calibration, False), "pre": _calibrate(adapter, calibration, True)}
    real = sum(len(encode(kv, CodecSpec("cachegen", 1), key=_KEY).data) for c in cases for kv in c.slices)
    print(
        f"check: cachegen level 1 itself: {real / sum(kv.num_tokens for c in cases for kv in c.slices):.0f} bytes/token"
    )
    variants = [("cachegen", None)] + [(f"klt keys {name}-RoPE", t) for name, t in transforms.items()]
    runs = [(name, lv, 1.0, t) for lv in (1, 0, 2, 3) for name, t in variants]
    runs += [(name, 3, s, t) for s in (1.5, 2.0) for name, t in variants]
    for name, level, scale, t in runs:

        def code(kv: ChunkKV, lv: int = level, s: float = scale, t: _Klt | None = t) -> tuple[ChunkKV, int]:
            return _klt_code(adapter, kv, lv, t, s)

        size, kl = _score(adapter, cases, code)
        print(f"{name} level {level} steps x{scale}: {size:.0f} bytes/token, KL {kl:.4f}", flush=True)


def klt_cost(adapter: ModelAdapter, cases: Sequence[_Case]) -> None:
    """Timed (run it on a quiet machine): cachegen level 1 decode alone, and with the inverse transform."""
    import time

    shape = (2, adapter.spec.num_layers, adapter.spec.num_kv_heads)
    d = adapter.spec.head_dim
    basis, mean = torch.linalg.qr(torch.randn(*shape, d, d))[0], torch.zeros(*shape, 1, d)
    decode_s = transform_s = 0.0
    elements = 0
    for kv in cases[0].slices:
        spec = CodecSpec("cachegen", 1)
        data, expect = encode(kv, spec, key=_KEY).data, Expected.of(kv, spec, _KEY)
        best = [float("inf"), float("inf")]
        for _ in range(5):
            start = time.perf_counter()
            out = decode(data, expect=expect)
            best[0] = min(best[0], time.perf_counter() - start)
            start = time.perf_counter()
            torch.baddbmm(  # x = z @ basis^T + mean, batched over (K/V, layer, head)
                mean.expand(-1, -1, -1, kv.num_tokens, -1).reshape(-1, kv.num_tokens, d),
                torch.stack([out.keys, out.values]).reshape(-1, kv.num_tokens, d),
                basis.transpose(3, 4).reshape(-1, d, d),
            )
            best[1] = min(best[1], time.perf_counter() - start)
        decode_s, transform_s, elements = decode_s + best[0], transform_s + best[1], elements + 2 * kv.keys.numel()
    mb = elements * 2 / 1e6
    print(f"decode {mb / decode_s:.0f} MB/s; decode + inverse transform {mb / (decode_s + transform_s):.0f} MB/s")


EXPERIMENTS = {  # name -> (function, built-in prompts used)
    "prerope": (prerope, 4),
    "entropy": (entropy, 3),
    "outliers": (outliers, 4),
    "sensitivity": (sensitivity, 3),
    "klt": (klt, 4),
    "klt_cost": (klt_cost, 1),
}


@torch.inference_mode()
def main(argv: list[str]) -> None:
    name = "builtin"
    if argv[1:2] == ["--prompts"] and len(argv) == 3:
        name, argv = argv[2], argv[:1]
    if len(argv) != 1 or argv[0] not in EXPERIMENTS:
        raise SystemExit(
            f"usage: python experiments/codec_experiments.py {{{','.join(EXPERIMENTS)}}} [--prompts builtin|packages]"
        )
    run, prompts = EXPERIMENTS[argv[0]]
    adapter = load_model("smollm2-135m")
    answer_tokens = 4 if argv[0] == "entropy" else 16 if argv[0] == "sensitivity" else 24
    max_tokens = 2000 if argv[0].startswith("klt") else 2800  # klt: the prompts of `ragkv bench codec`
    cases = [_prepare(adapter, p, answer_tokens) for p in prompt_set(name, adapter, n=prompts, max_tokens=max_tokens)]
    run(adapter, cases)


if __name__ == "__main__":
    main(sys.argv[1:])
