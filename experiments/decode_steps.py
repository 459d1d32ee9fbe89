"""Decode-step time per decode copy and batch size, the engine's start per copy, and fp16 packing.

    python experiments/decode_steps.py --model M [--contexts 200,2000] [--rows 1,4] [--weights model,int8,fp16]
        [--steps 6] [--starts] [--pack]

Steps: one full prefill of ``context`` tokens, then ``DecodeBatch`` steps of ``rows`` rows over it
(ms per step, the mean of ``--steps`` after 2 untimed). ``--starts``: seconds to build a ``RagKV``
on the model with each ``decode_weights`` (a fresh process each, so no copy is reused). ``--pack``:
seconds FBGEMM takes to pack the LM head for fp16 whole and in ``FP16_BLOCK_ROWS`` blocks.
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
    args = ap.parse_args()
    steps(args)
    if args.starts:
        starts(args)
    if args.pack:
        pack(args)


if __name__ == "__main__":
    main()
