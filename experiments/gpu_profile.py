"""Where a fused request's GPU memory and host time go (16K tokens, Llama-3.1-8B shape, bf16).

    python experiments/gpu_profile.py [--context 16384] [--out DIR]

Prints the largest allocations made during one fused request from the device tier (with the
Python frames that made them; the layers replayed as CUDA graphs allocate nothing there: their
pool is ``ragkv bench gpu``'s "graphs GiB"), the operators that synchronize the host with the device (``item``,
``nonzero``, device-to-host copies) in the question probe and in a whole fused request, the
probe's operators by host time, and a whole fused request's device time by kernel and by where in
the code it was launched (ragkv's line and the innermost Python line: a norm, the MLP, the
attention, the selection's bookkeeping). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import collections
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from ragkv.bench import gpu as g
from ragkv.fusion import FusionConfig

_SYNCING = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaMemcpyAsync",
            "cudaDeviceSynchronize", "aten::unique", "aten::_unique2", "aten::equal", "aten::is_nonzero")  # fmt: skip


def _frames(event: dict) -> str:
    frames = [f for f in event.get("frames", []) if str(f.get("filename", "")).endswith(".py")]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:7])


def by_source(events: list, attr: str = "self_device_time_total") -> collections.Counter[tuple[str, str]]:
    """Each operator's own ``attr`` time (us) summed by where it was called: the innermost frame in ragkv's
    code and the innermost Python frame (a modeling file's norm, MLP or attention, say). Operators on
    the host only (each kernel's device time counts with the operator that launched it); needs a
    profile recorded with Python stacks (``with_stack=True`` and a verbose experimental config)."""
    from torch.autograd import DeviceType

    totals: collections.Counter[tuple[str, str]] = collections.Counter()
    for ev in events:
        t = getattr(ev, attr, 0) or 0
        if t <= 0 or ev.device_type != DeviceType.CPU:
            continue
        frames = [_short(f) for f in ev.stack if ".py(" in f]
        ours = next((f for f in frames if f.startswith("ragkv/")), "-")
        inner = next((f for f in frames if not f.startswith("torch/")), "-")  # past torch's own modules
        totals[(ours, inner)] += t
    return totals


def _short(frame: str) -> str:
    """A frame from its package on: ``/x/site-packages/transformers/...`` as ``transformers/...`` (the
    root found last in the path: a checkout named ragkv with a venv inside stays torch's)."""
    frame = frame.replace("\\", "/")
    if frame.startswith(("ragkv/", "transformers/", "torch/")):
        return frame
    at = max(frame.rfind("/" + root) for root in ("ragkv/", "transformers/", "torch/"))
    return frame[at + 1 :] if at >= 0 else frame


def _print_by_source(prof: profile, top: int = 22) -> None:
    from torch.autograd import DeviceType

    totals = by_source(prof.events())
    whole = sum(totals.values())
    kernels = sum(ev.device_time_total for ev in prof.events() if ev.device_type == DeviceType.CUDA)
    print(
        f"--- fused: device time by where it was launched (ms; {whole / 1e3:.1f} attributed, {kernels / 1e3:.1f} "
        "in the device's kernels: the rest ran outside an operator, as CUDA graph replays do)"
    )
    files: collections.Counter[str] = collections.Counter()
    for (ours, _), t in totals.items():
        files[ours.split("(")[0]] += t
    for name, t in files.most_common(12):
        print(f"  {t / 1e3:8.2f}  {name}")
    for (ours, inner), t in totals.most_common(top):
        print(f"  {t / 1e3:8.2f}  {ours}  <-  {inner}")


def _recorded(fn: Callable[[], object], stacks: bool) -> tuple[profile, Any]:
    """``fn`` profiled on the host and the device (with Python stacks if ``stacks``), and its
    operators' averages (reading the events back is where a profile can fail)."""
    config = _ExperimentalConfig(verbose=True) if stacks else None  # verbose, or no stacks are kept
    # The Python tracer keeps pointers into code objects' names and reads them only when the events
    # are read back: a code object freed in between (a garbage collection of an older function's)
    # leaves a name of freed bytes (pytorch/pytorch#64345, ROCm/aiter#4623). No collection runs
    # until the events are read; ``main`` warms up first, so no code is generated in the profile.
    gc.collect()
    gc.disable()
    try:
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks, experimental_config=config
        ) as prof:
            fn()
            torch.cuda.synchronize()
        return prof, prof.key_averages()
    finally:
        gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    a = g.build_model(g.LLAMA_3_1_8B, torch.device("cuda"), torch.bfloat16)
    p = g._prompt(a.spec.vocab_size, args.context, 512)
    prefix = a.prefill_kv(p.prefix)
    chunks = [a.prefill_kv(c, past=[prefix]) for c in p.chunks]
    cfg = FusionConfig()
    for _ in range(2):
        g._fused(a, prefix, chunks, p, cfg)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    g._fused(a, prefix, chunks, p, cfg)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"fused from the device tier at {args.context}: peak {peak:.2f} GiB over {base / 2**30:.2f} GiB held before")
    allocs = sorted((e for e in snap["device_traces"][0] if e["action"] == "alloc"), key=lambda e: -e["size"])
    for e in allocs[:14]:
        print(f"{e['size'] / 2**20:10.1f} MiB  {_frames(e)}")
    feed = g._feed(a, prefix, chunks, len(p.question))
    for name, fn in (("probe", lambda: g._probe(a, feed, p)), ("fused", lambda: g._fused(a, prefix, chunks, p, cfg))):
        stacks = name == "fused"  # where its device time was launched: Python stacks (verbose, or none are kept)
        try:
            prof, rows = _recorded(fn, stacks)
        except UnicodeDecodeError as e:  # an event named by freed bytes all the same (see _recorded)
            print(f"--- {name}: the profile with Python stacks could not be read back ({e}); again without them")
            prof, rows = _recorded(fn, stacks=False)
            stacks = False
        print(f"--- {name}: syncing operators (count, host ms)")
        for r in rows:
            if r.key in _SYNCING:
                print(f"  {r.key:32s} {r.count:6d} {r.cpu_time_total / 1e3:9.2f}")
        kernels = sum(r.count for r in rows if r.key == "cudaLaunchKernel")
        replays = sum(r.count for r in rows if r.key == "cudaGraphLaunch")
        print(f"--- {name}: kernels launched {kernels}, CUDA graphs replayed {replays}")
        if name == "probe":
            print(rows.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=48))
        else:  # where a fused request's device time goes (the recompute's kernels)
            try:
                print(rows.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=48))
            except (KeyError, AttributeError, ValueError):
                print(rows.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=48))
            if stacks:
                _print_by_source(prof)
        if name == "probe":
            prof.export_chrome_trace(str(args.out / f"{name}.json"))


if __name__ == "__main__":
    main()
