"""Memory traffic of one default fusion at Llama-3.1-8B's shape, by kind of work, counted on the CPU.

    python experiments/gpu_traffic.py [--context 16384] [--scale 4] [--hbm-gbs 2960]
                                       [--no-kernels | --no-attention-kernel]

On a GPU the recompute took 2.3x the time its FLOPs need (docs/benchmarks.md, "GPU"): besides the
matrix products and the attention, an eager decoder layer runs a dozen elementwise passes
(the RMSNorms in fp32, the rotary embedding, SiLU and the gate's product, the residual adds), and
placement re-rotates every moved chunk key in fp32. Each pass reads and writes whole activations
from device memory. This counts those bytes on the CPU, through the same code, and turns them
into the time they need at a device memory rate (default: the copy rate the last H100 run
measured), a floor for that work however the launches are made.

The model is Llama-3.1-8B's with every width divided by ``--scale`` (hidden size, heads, KV heads,
MLP) and everything else kept (32 layers, head dim 128, the context's tokens); the chunks are
random K/V at the positions they would be computed at. A tensor with a dimension of one of the
divided widths (activations, K/V) then holds ``1/scale`` of its full-width bytes, and counts
``scale`` times them; the others (masks ``[rows, slots]``, rotary tables ``[rows, 128]``) count
as they are. Scales 2 and 4 agree (a check of that rule). Matrix products and the attention
kernels are left out: their time is FLOPs (the bench's bounds). The attention runs torch's SDPA
with fusion's masks, placement turns the keys as stored and the probe's products run in the
model's dtype, as on a GPU (ragkv's CPU attention kernel is switched off); placement's moved keys
are turned as ragkv's Triton kernel turns them on a GPU, one read of each key and its tables and
one write, and the probe's scores are scaled and masked in one pass as its kernel does (both counted
by hand; ``--no-kernels``: through torch, as with ``RAGKV_TRITON=0``). With the kernels the
recompute's attention runs from the rows' positions as ``ragkv.gpu.attention``'s kernel does where
its choice takes it, so no mask is made (without them, or with ``--no-attention-kernel`` alone:
SDPA with fusion's masks). A product of a
half-precision and an fp32 tensor converts as it reads on a GPU; on the CPU torch makes an fp32
temporary first, which this does not count. Whether a GPU's fused kernel shares the key heads of
the blocked attention (``ragkv.model.attention._shares_heads``) is torch's choice there; the CPU's
flash kernel does, so no repeat is counted (at 16K one would add 16 GB).

Counted per ATen call: the tensors read and written, views (not a ``reshape`` that copies) and
allocations excluded; an in-place
write into a larger tensor (a scatter into the cache, a copy into the fused buffer) counts the
bytes written, not the destination. Exact for the code as it runs, the same on any machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragkv import fusion  # noqa: E402
from ragkv.bench.gpu import LLAMA_3_1_8B, _fused, _prompt, build_model  # noqa: E402
from ragkv.fusion import FusionConfig  # noqa: E402
from ragkv.gpu import attention as gattn  # noqa: E402
from ragkv.gpu import feed, kernels  # noqa: E402
from ragkv.model import attention  # noqa: E402
from ragkv.model.attention import PLAIN  # noqa: E402
from ragkv.model.placement import cpu_has_native_bf16  # noqa: E402
from ragkv.types import ChunkKV  # noqa: E402

_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
_FLOPS = ("matrix products", "attention")  # timed by their FLOPs, not counted here
_MATMUL = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"}
_FREE = {
    "_fused_sdp_choice",
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros",
    "ones",
    "arange",
    "full",
    "scalar_tensor",
}
_INTO = {"copy_", "index_put_", "index_copy_", "_index_put_impl_", "masked_scatter_", "slice_scatter"}
# where the innermost ragkv frame is, read as a kind of work
_KINDS = (
    ("ragkv/gpu/feed.py", "placement (copies in, re-rotation)"),
    ("ragkv/model/rotary.py", "placement (copies in, re-rotation)"),
    ("ragkv/model/caches.py", "writes into the cache"),
    ("ragkv/model/attention.py", "the attention's other passes (the probe's softmax, any K/V repeat)"),
    ("ragkv/model/masks.py", "masks"),
    ("ragkv/fusion.py", "selection and bookkeeping"),
    ("ragkv/selection.py", "selection and bookkeeping"),
)


def _copied(args: Any, out: Any) -> bool:
    """Whether an op that may return a view (``reshape`` does) made a copy instead."""
    src = next((t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
    res = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
    if src is None or res is None:
        return False
    return src.untyped_storage().data_ptr() != res.untyped_storage().data_ptr()


class Traffic(TorchDispatchMode):
    """Bytes read and written per (kind, op, source line) while active, at full width: a tensor with a
    dimension of one of ``widths`` (the model's divided widths) counts ``scale`` times its bytes."""

    def __init__(self, widths: set[int], scale: int) -> None:
        super().__init__()
        self.widths, self.scale = widths, scale
        self.bytes: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.paused = False  # while a stand-in computes what a GPU kernel would (its bytes added by hand)

        self.active = False  # inside the with block

    def __enter__(self) -> Traffic:
        self.active = True
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def kernel(self, kind: str, name: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        """Count one GPU kernel that reads ``reads`` once and writes ``writes`` once (while active)."""
        if self.active:
            self.bytes[(kind, name, "ragkv/gpu/kernels.py")] += sum(self._bytes(t) for t in reads + writes)

    def _bytes(self, t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        wide = self.scale if self.widths.intersection(t.shape) else 1
        return t.numel() * t.element_size() * wide

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or name in _FREE or (func.is_view and not _copied(args, out)):
            return out
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        if name in _INTO:  # the destination is written where the source lands: count the source twice
            moved = 2 * sum(self._bytes(t) for t in ins[1:])
        else:
            moved = sum(self._bytes(t) for t in ins) + sum(self._bytes(t) for t in tree_flatten(out)[0])
        where, kind = "?", "the model's layers (norms, rotary, MLP, residuals)"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if frame.filename.startswith(_ROOT + "ragkv/"):
                rel = frame.filename.removeprefix(_ROOT)
                where = f"{rel}:{frame.lineno} {frame.name}"
                kind = next((k for path, k in _KINDS if rel == path), kind)
                break
        if name in _MATMUL:
            kind = "matrix products"
        elif "attention" in name:
            kind = "attention"
        self.bytes[(kind, name, where)] += moved
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens (chunks of 512)")
    ap.add_argument("--scale", type=int, default=4, help="divide the widths by this (1, 2 or 4)")
    ap.add_argument("--hbm-gbs", type=float, default=2960.0, help="device memory rate for the time column, GB/s")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), bf16 or fp32")
    ap.add_argument("--top", type=int, default=12, help="source lines to list")
    ap.add_argument(
        "--no-kernels",
        action="store_true",
        help="placement and the probe's scores through torch, not ragkv's Triton kernels (RAGKV_TRITON=0)",
    )
    ap.add_argument(
        "--no-attention-kernel",
        action="store_true",
        help="the recompute's attention through SDPA with fusion's masks (RAGKV_ATTENTION_KERNEL=0), the "
        "other kernels kept",
    )
    args = ap.parse_args()
    s = args.scale
    if s not in (1, 2, 4):
        ap.error("--scale must be 1, 2 or 4 (at 8 the one KV head's dimension of 1 reads as a broadcast one)")
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and cpu_has_native_bf16())
    dtype = torch.bfloat16 if bf16 else torch.float32  # the GPU runs bf16; fp32 doubles the bytes
    shape = dict(LLAMA_3_1_8B, vocab_size=4096)
    for key in _WIDTHS:
        shape[key] = LLAMA_3_1_8B[key] // s
    a = build_model(shape, torch.device("cpu"), dtype)
    a.scattered = lambda query_pos: PLAIN  # type: ignore[method-assign]  # torch's attention and masks, as on a GPU
    feed._turns_as_stored = lambda device: True  # placement's arithmetic as on a GPU
    attention._half_products = lambda query: query.dtype != torch.float32  # the probe's products, as on a GPU
    p = _prompt(shape["vocab_size"], args.context, 512)
    g = torch.Generator().manual_seed(1)
    spec = a.spec

    def chunk(n: int, start: int) -> ChunkKV:
        k = torch.randn(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, generator=g).to(dtype)
        return ChunkKV(k, torch.randn(k.shape, generator=g).to(dtype), torch.arange(start, start + n), a.fingerprint)

    prefix = chunk(len(p.prefix), 0)
    chunks = [chunk(len(c), len(p.prefix)) for c in p.chunks]
    widths = {shape[key] for key in _WIDTHS}
    traffic = Traffic(widths if s > 1 else set(), s)
    if not args.no_kernels:  # as on a GPU with Triton: placement's keys turned by ragkv's kernel
        feed.kernel_turns = lambda adapter: True  # type: ignore[assignment]

        def turn(k: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor) -> None:
            traffic.kernel("placement (copies in, re-rotation)", "turn_keys_", [k, cos_d, sin_d], [k])
            traffic.paused = True  # the same numbers through torch, uncounted: the interpreter is slow
            try:
                feed._turn_with_torch(k, cos_d, sin_d, a.rotary_fn)
            finally:
                traffic.paused = False

        kernels.turn_keys_ = turn  # type: ignore[assignment]

        # and the probe's scores scaled and masked in one pass, as its replayed layers do on a GPU
        def scale_mask(raw: torch.Tensor, scale: float, mask: Any) -> torch.Tensor | None:
            if type(mask) is not torch.Tensor or mask.dtype == torch.bool:  # as kernels.scale_mask_fits
                return None  # (the CPU's probe mask is bf16, a GPU's fp32: counted as fp32 below)
            out = torch.empty(raw.shape, dtype=torch.float32)
            kind = "the attention's other passes (the probe's softmax, any K/V repeat)"
            traffic.kernel(kind, "scale_mask", [raw, mask.float()], [out])  # the mask read once, in fp32
            traffic.paused = True
            try:
                hq, q = raw.shape[1] * raw.shape[2] // mask.shape[2], mask.shape[2]
                scores = (raw.float() * scale).view(1, hq, q, raw.shape[3]) + mask.float()
                return out.copy_(scores.view(raw.shape))
            finally:
                traffic.paused = False

        # and the recompute's attention from the rows' positions, as ragkv.gpu.attention computes it on a
        # GPU: no mask is made (its reads and writes are the attention's, timed by FLOPs, not counted)
        def position_kernel(
            query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, scale: float | None
        ) -> torch.Tensor | None:
            traffic.paused = True  # the same numbers through torch, uncounted (the interpreter is slow)
            try:
                return gattn.masked_reference(query, key, value, positions, scale)
            finally:
                traffic.paused = False

        if not args.no_attention_kernel:
            fusion.attention_kernel = lambda adapter: position_kernel  # type: ignore[assignment]
        probe_attention = attention._probe_attention
        attention._probe_attention = lambda *args: probe_attention(*args, scale_mask)  # type: ignore[assignment,call-arg]
    with torch.inference_mode():
        _fused(a, prefix, chunks, p, FusionConfig())  # warm-up: what runs once per process is not counted
        with traffic:
            fused = _fused(a, prefix, chunks, p, FusionConfig())
    tokens = sum(len(c) for c in p.chunks) + len(p.prefix) + len(p.question)
    print(
        f"{tokens:,} prompt tokens, Llama-3.1-8B's shape at 1/{s} width ({dtype}), the default fusion "
        f"({fused.recomputed_tokens:,} chunk tokens recomputed); bytes at full width, time at {args.hbm_gbs:,.0f} GB/s"
    )
    kinds: collections.Counter[str] = collections.Counter()
    for (kind, _, _), n in traffic.bytes.items():
        kinds[kind] += n
    print(f"\n| work | GB moved | ms at {args.hbm_gbs:,.0f} GB/s |\n|---|--:|--:|")
    full = {kind: n / 1e9 for kind, n in kinds.items() if kind not in _FLOPS}
    for kind, gb in sorted(full.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {gb:,.1f} | {gb / args.hbm_gbs * 1e3:,.1f} |")
    total = sum(full.values())
    print(f"| all but the products and the attention | {total:,.1f} | {total / args.hbm_gbs * 1e3:,.1f} |")
    print(f"\nthe {args.top} source lines moving the most (GB at full width, ATen op):")
    lines = [(n, k) for k, n in traffic.bytes.items() if k[0] not in _FLOPS]
    for n, (_, name, where) in sorted(lines, reverse=True)[: args.top]:
        print(f"  {n / 1e9:7.2f}  {name:16s} {where}")


if __name__ == "__main__":
    main()
