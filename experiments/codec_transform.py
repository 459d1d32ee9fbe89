"""The channel transform and the sensitivity-derived steps, apart and together (issue 26): bytes and KL.

    python experiments/codec_transform.py --model M --levels 0,1,2,3 --scales 1.0 [--report 4] [--tune 2]

Calibration (basis, per-layer on/off, per-layer sensitivity) on builtin prompts 4-7, as
``ragkv bench codec --calibrate builtin`` does; scored on builtin prompts 0..tune-1 (the set
defaults are chosen on) and packages prompts 0..report-1 (the held-out set), with the codec
bench's scoring (KL(exact || decoded) over the question and the exact cache's greedy answer).
Variants: plain cachegen; the basis alone; the step scales alone; both. ``--scales`` multiplies
every step of a level (a point between levels). Nothing is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ragkv.bench.codec import _kl, _prepare, measure_sensitivity, rope_frequencies
from ragkv.bench.prompt_sets import prompt_set
from ragkv.codec import cachegen, decode, encode
from ragkv.codec.calibrate import calibrate, step_scales
from ragkv.codec.schedule import StepSchedule
from ragkv.codec.transform import ChannelTransform
from ragkv.types import CodecSpec, StorageKey, tenant_namespace

_KEY = StorageKey(f"{tenant_namespace('ragkv-bench')}/codec-transform")
_SPARE = 99


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--levels", default="0,1,2,3")
    parser.add_argument("--scales", default="1.0")
    parser.add_argument("--tune", type=int, default=2)
    parser.add_argument("--report", type=int, default=4)
    parser.add_argument("--variants", default="plain,basis,steps,both")
    args = parser.parse_args()
    from ragkv.model import load_model

    adapter = load_model(args.model, dtype="auto")
    start = time.perf_counter()
    calib = [_prepare(adapter, p, 16) for p in prompt_set("builtin", adapter, n=8, max_tokens=2000)[4:]]
    basis = calibrate([kv for c in calib for kv in c.slices], inv_freq=rope_frequencies(adapter))
    kl = measure_sensitivity(adapter, calib, 1)
    scales = step_scales(kl)
    print(
        f"calibrated in {time.perf_counter() - start:.0f}s; basis on: keys {sum(basis.enabled[0])}, "
        f"values {sum(basis.enabled[1])} of {len(basis.enabled[0])} layers",
        flush=True,
    )
    print("sensitivity keys  " + " ".join(f"{v:.4f}" for v in kl[0]))
    print("sensitivity values " + " ".join(f"{v:.4f}" for v in kl[1]))
    print("scales keys  " + " ".join(f"{v:.2f}" for v in scales[0]))
    print("scales values " + " ".join(f"{v:.2f}" for v in scales[1]), flush=True)
    layers = len(basis.enabled[0])
    off = ((False,) * layers, (False,) * layers)
    variants: dict[str, ChannelTransform | None] = {
        "plain": None,
        "basis": basis,
        "steps": dataclasses.replace(basis, enabled=off, step_scales=scales),
        "both": dataclasses.replace(basis, step_scales=scales),
    }
    sets = {
        "builtin": [_prepare(adapter, p, 24) for p in prompt_set("builtin", adapter, n=args.tune, max_tokens=2000)],
        "packages": [_prepare(adapter, p, 24) for p in prompt_set("packages", adapter, n=args.report, max_tokens=2000)],
    }
    int8 = {
        name: sum(len(encode(kv, CodecSpec("int8", 0), key=_KEY).data) for c in cases for kv in c.slices)
        for name, cases in sets.items()
    }
    cachegen.CacheGenCodec.levels = (*cachegen.CacheGenCodec.levels, _SPARE)
    for level in [int(x) for x in args.levels.split(",")]:
        for scale in [float(x) for x in args.scales.split(",")]:
            base = cachegen.LEVELS[level]
            cachegen.LEVELS[_SPARE] = dataclasses.replace(
                base,
                key_steps=tuple(s * scale for s in base.key_steps),  # type: ignore[arg-type]
                value_steps=tuple(s * scale for s in base.value_steps),  # type: ignore[arg-type]
            )
            assert isinstance(cachegen.LEVELS[_SPARE], StepSchedule)
            for name in args.variants.split(","):
                cells = [f"level {level} x{scale} {name}:"]
                for set_name, cases in sets.items():
                    nbytes, kls = _score(adapter, cases, variants[name])
                    tokens = sum(kv.num_tokens for c in cases for kv in c.slices)
                    cells.append(
                        f"{set_name} {nbytes / tokens:,.0f} B/t (1/{int8[set_name] / nbytes:.2f}) KL {kls:.4f}"
                    )
                print(" | ".join(cells), flush=True)


def _score(adapter: object, cases: list, transform: ChannelTransform | None) -> tuple[int, float]:
    spec = CodecSpec("cachegen", _SPARE)
    nbytes = 0
    kls = []
    for case in cases:
        decoded = []
        for kv, sal in zip(case.slices, case.saliency, strict=True):
            data = encode(kv, spec, key=_KEY, saliency=sal, transform=transform).data
            nbytes += len(data)
            decoded.append(decode(data, expect=None, transform=transform))
        kls.append(_kl(case.logits, adapter.suffix_logits(decoded, case.suffix, case.answer)))  # type: ignore[attr-defined]
    return nbytes, float(torch.cat(kls).mean())


if __name__ == "__main__":
    main()
