"""Decode-step time per decode copy and batch size, the engine's start per copy, and fp16 packing.

    python experiments/decode_steps.py --model M [--contexts 200,2000] [--rows 1,4] [--weights model,int8,fp16]
        [--steps 6] [--starts] [--pack] [--kernels] [--lean]

Steps: one full prefill of ``context`` tokens, then ``DecodeBatch`` steps of ``rows`` rows over it
(ms per step, the mean of ``--steps`` after 2 untimed). ``--starts``: seconds to build a ``RagKV``
on the model with each ``decode_weights`` (a fresh process each, so no copy is reused). ``--pack``:
seconds FBGEMM takes to pack the LM head for fp16 whole and in ``FP16_BLOCK_ROWS`` blocks.
``--kernels``: every int8 matrix of the model (its decoder and LM head, as the copy quantizes them)
through ragkv's kernel, torch's int8 kernel and fp16, ms for one pass over all of them (the best of
5), as a decode step streams them from memory. ``--lean``: the lean decode layers against
transformers' layers (``RAGKV_LEAN_DECODE``), interleaved 6 times on one engine, median ms per
int8 step at 1,000 tokens of context.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.model.batch import DecodeBatch
from ragkv.model.quant import FP16_BLOCK_ROWS
from ragkv.retriever.embedder import HashingEmbedder

TEXT = "The quick brown fox jumps over the lazy dog. " * 400


def _engine(model: str, tmp: str, weights: str = "auto") -> RagKV:
    cfg = EngineConfig(model=model, data_dir=Path(tmp), store=("memory://",), decode_weights=weights)
    return RagKV(cfg, embedder=HashingEmbedder(dim=64))


def steps(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, _engine(args.model, tmp) as rag, torch.inference_mode():
        a = rag.adapter
        print(f"model {args.model}, dtype {a.dtype}, {torch.get_num_threads()} threads; {rag.decode_weights_reason}")
        ids = a.encode(TEXT)
        for context in (int(c) for c in args.contexts.split(",")):
            pre = rag.prefill([a.decode(ids[:context])], mode="full")
            token = int(torch.argmax(pre.logits))
            for weights in args.weights.split(","):
                for rows in (int(r) for r in args.rows.split(",")):
                    batch = DecodeBatch(a, weights=weights)  # type: ignore[arg-type]
                    for r in range(rows):
                        batch.add(f"r{r}", pre.cache, pre.num_tokens, reserve=args.steps + 4)
                    for _ in range(2):
                        batch.step([token] * rows)
                    began = time.perf_counter()
                    for _ in range(args.steps):
                        batch.step([token] * rows)
                    ms = 1000 * (time.perf_counter() - began) / args.steps
                    print(f"context {pre.num_tokens:5d} {weights:>5} rows {rows}: {ms:6.1f} ms/step", flush=True)


def starts(args: argparse.Namespace) -> None:
    for weights in dict.fromkeys(["model", *args.weights.split(","), "auto"]):
        code = (
            "import sys, tempfile, time; sys.path.insert(0, 'experiments'); from decode_steps import _engine\n"
            "t = time.perf_counter()\n"
            f"with tempfile.TemporaryDirectory() as tmp, _engine({args.model!r}, tmp, {weights!r}) as rag:\n"
            "    print(f'{time.perf_counter() - t:.1f} s', rag.decode_weights)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        print(f"start with decode_weights={weights}: {out.strip()}", flush=True)


def kernels(args: argparse.Namespace) -> None:
    from torch import nn

    from ragkv.model import native
    from ragkv.model.quant import quantize_int8

    with tempfile.TemporaryDirectory() as tmp, _engine(args.model, tmp, "model") as rag, torch.inference_mode():
        model = rag.adapter.model
        linears = [m for m in [*model.model.layers.modules(), model.lm_head] if isinstance(m, nn.Linear)]
        mats = []
        for m in linears:
            q, s = quantize_int8(m.weight, torch.float32)
            fp16 = torch.ops.quantized.linear_prepack_fp16(m.weight.detach().float(), None)
            mats.append((native.int8_kernel(q, s) if native.int8_available() else None, q, s.bfloat16(), fp16))
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, m.in_features) for m in linears]
            for name in ("ragkv int8", "torch int8", "fp16"):
                if name == "ragkv int8" and mats[0][0] is None:
                    continue
                _one_pass(name, mats, xs)
                best = min(_timed(_one_pass, name, mats, xs) for _ in range(5))
                print(f"rows {rows}: {name:>10} {best:6.1f} ms for all {len(mats)} matrices", flush=True)


def _one_pass(name: str, mats: list, xs: list) -> None:
    for (fast, q, scales, fp16), x in zip(mats, xs, strict=True):
        if name == "ragkv int8":
            fast(x)
        elif name == "torch int8":
            torch._weight_int8pack_mm(x.bfloat16(), q, scales)
        else:
            torch.ops.quantized.linear_dynamic_fp16(x, fp16)


def _timed(run, *args) -> float:
    began = time.perf_counter()
    run(*args)
    return 1000 * (time.perf_counter() - began)


def lean(args: argparse.Namespace) -> None:
    import os
    import statistics

    with tempfile.TemporaryDirectory() as tmp, _engine(args.model, tmp, "int8") as rag, torch.inference_mode():
        a = rag.adapter
        pre = rag.prefill([a.decode(a.encode(TEXT)[:1000])], mode="full")
        token = int(torch.argmax(pre.logits))
        for rows in (int(r) for r in args.rows.split(",")):
            times: dict[str, list[float]] = {"1": [], "0": []}
            for _ in range(6):
                for flag in ("1", "0"):
                    os.environ["RAGKV_LEAN_DECODE"] = flag
                    batch = DecodeBatch(a, weights="int8")
                    for r in range(rows):
                        batch.add(f"r{r}", pre.cache, pre.num_tokens, reserve=20)
                    batch.step([token] * rows)
                    times[flag] += [_timed(batch.step, [token] * rows) for _ in range(10)]
            lean_ms, hf_ms = statistics.median(times["1"]), statistics.median(times["0"])
            print(f"rows {rows}: lean {lean_ms:.1f} ms/step, transformers' layers {hf_ms:.1f} ms/step", flush=True)
        os.environ.pop("RAGKV_LEAN_DECODE", None)


def pack(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, _engine(args.model, tmp, "model") as rag:
        head = rag.adapter.model.lm_head.weight.detach().float()
        began = time.perf_counter()
        torch.ops.quantized.linear_prepack_fp16(head, None)
        whole = time.perf_counter() - began
        began = time.perf_counter()
        for w in head.split(FP16_BLOCK_ROWS):
            torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)
        blocks = time.perf_counter() - began
        print(f"fp16 packing of the LM head {tuple(head.shape)}: whole {whole:.2f} s, in blocks {blocks:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="200,2000")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--weights", default="model,int8,fp16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--starts", action="store_true", help="also time the engine's start per decode copy")
    ap.add_argument("--pack", action="store_true", help="also time fp16 packing of the LM head, whole and in blocks")
    ap.add_argument("--kernels", action="store_true", help="only time every int8 matrix through each kernel")
    ap.add_argument("--lean", action="store_true", help="only time lean decode layers against transformers' layers")
    args = ap.parse_args()
    if args.kernels or args.lean:
        if args.kernels:
            kernels(args)
        if args.lean:
            lean(args)
        return
    steps(args)
    if args.starts:
        starts(args)
    if args.pack:
        pack(args)


if __name__ == "__main__":
    main()
