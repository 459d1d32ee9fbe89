"""Salient-token precision sweep (issue 26): bytes and KL of cachegen variants, no timing.

    python experiments/codec_salient.py --model smollm2-135m --prompts builtin --limit 4

Each variant is a StepSchedule put in ``cachegen.LEVELS`` under a spare level number for the
run; prompts, slices, saliency and scoring are the codec bench's (``ragkv.bench.codec``).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

import ragkv.codec.cachegen as cachegen
from ragkv.bench.codec import _kl, _prepare
from ragkv.bench.prompt_sets import prompt_set
from ragkv.codec import Expected, decode, encode
from ragkv.codec.schedule import StepSchedule
from ragkv.types import CodecSpec, StorageKey, tenant_namespace

_KEY = StorageKey(f"{tenant_namespace('ragkv-bench')}/codec-salient")
_SPARE = 99


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="builtin")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--scales", default="1.0")
    parser.add_argument("--shares", default="0,0.05,0.1,0.2")
    parser.add_argument("--shifts", default="1,2")
    parser.add_argument("--levels", default="1,3")
    parser.add_argument("--sources", default="attention,proxy")
    args = parser.parse_args()
    from ragkv.model import load_model

    adapter = load_model(args.model)
    cases = [_prepare(adapter, p, 24) for p in prompt_set(args.prompts, adapter, n=args.limit, max_tokens=2000)]
    int8 = sum(len(encode(kv, CodecSpec("int8", 0), key=_KEY).data) for c in cases for kv in c.slices)
    tokens = sum(kv.num_tokens for c in cases for kv in c.slices)
    print(f"int8 {int8 / tokens:.0f} bytes/token", flush=True)
    cachegen.levels_backup = dict(cachegen.LEVELS)  # type: ignore[attr-defined]
    cachegen.CacheGenCodec.levels = (*cachegen.CacheGenCodec.levels, _SPARE)
    for level, scale, share, shift, source in itertools.product(
        [int(x) for x in args.levels.split(",")],
        [float(x) for x in args.scales.split(",")],
        [float(x) for x in args.shares.split(",")],
        [int(x) for x in args.shifts.split(",")],
        args.sources.split(","),
    ):
        if share == 0 and (shift != int(args.shifts.split(",")[0]) or source != args.sources.split(",")[0]):
            continue
        base = cachegen.levels_backup[level]  # type: ignore[attr-defined]
        cachegen.LEVELS[_SPARE] = StepSchedule(
            key_steps=tuple(s * scale for s in base.key_steps),  # type: ignore[arg-type]
            value_steps=tuple(s * scale for s in base.value_steps),  # type: ignore[arg-type]
            salient_share=share,
            salient_shift=shift if share else 0,
        )
        spec = CodecSpec("cachegen", _SPARE)
        nbytes = 0
        kls = []
        start = time.perf_counter()
        for case in cases:
            decoded = []
            for kv, sal in zip(case.slices, case.saliency, strict=True):
                data = encode(kv, spec, key=_KEY, saliency=sal if source == "attention" else None).data
                nbytes += len(data)
                decoded.append(decode(data, expect=Expected.of(kv, spec, _KEY)))
            kls.append(_kl(case.logits, adapter.suffix_logits(decoded, case.suffix, case.answer)))
        kl = float(torch.cat(kls).mean())
        print(
            f"level {level} x{scale} share {share} shift {shift} {source}: {nbytes / tokens:.0f} bytes/token, "
            f"1/{int8 / nbytes:.2f} of int8, KL {kl:.4f} ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
