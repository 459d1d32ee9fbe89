"""Fusion's recompute attention on a GPU, computed from the rows' positions by a Triton kernel.

A fused pass runs rows at scattered slots of the cache: the row at slot ``p`` sees the slots up to
``p``. Through torch that needs the mask as a tensor (``ragkv.model.masks.PositionMask``), made a
block of rows at a time at long contexts, and SDPA with an arbitrary mask computes every slot its
block covers: at 16K tokens of Llama-3.1-8B's shape the recompute's attention took 84 ms on an
H100, the largest part of the recompute (docs/benchmarks.md, "GPU"), and its masks move 7.4 GB.
:func:`position_attention` is a flash kernel that reads each row's position instead: no mask, and
each tile of rows walks the key slots only up to its last row's position, so a recompute whose
rows are spread over the context does about half the work of a mask over every slot (what the
CPU's native kernel, ``ragkv.model.native_attention``, does there).

It is within rounding of SDPA's output, not bit for bit (a flash kernel orders its sums by tile,
as SDPA's own kernels do, differently): checked on each device against an fp32 reference, with
an error bound set by what SDPA itself makes on the same inputs (:func:`_check`).

Whether fusion uses it (:func:`attention_kernel`), per device, dtype and head layout:
``RAGKV_ATTENTION_KERNEL`` ``auto`` (the default) times it against SDPA with the mask on a
recompute-like call and keeps the faster (:func:`_choose`, once; logged); ``1`` uses it wherever
it passes the check; ``0`` never. ``RAGKV_TRITON=0`` switches it off with ragkv's other kernels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ragkv.gpu import kernels
from ragkv.model.adapter import ModelAdapter
from ragkv.model.attention import fused_pass_attention
from ragkv.model.masks import PositionKernel, PositionMask

logger = logging.getLogger(__name__)

__all__ = ["ENV", "Config", "attention_kernel", "fits", "masked_reference", "mode", "position_attention"]

ENV = "RAGKV_ATTENTION_KERNEL"
Mode = Literal["auto", "on", "off"]
_LOG2E = 1.4426950408889634
_HEAD_DIMS = (64, 128)  # a power of two the kernel's tiles take, and shared memory holds on an H100


@dataclass(frozen=True, slots=True)
class Config:
    """A launch's tiles: ``block_m`` rows of one query head per program, ``block_n`` key slots a step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tried on a GPU by the timed choice, the first that compiles taken where the choice is not timed.
# The FlashAttention-2 tiles Triton's fused-attention tutorial tunes among for an H100 (head dim 128).
_CUDA_CONFIGS = (Config(128, 64, 8, 3), Config(64, 64, 4, 3), Config(128, 128, 8, 2))
_INTERPRETED = Config(16, 16, 1, 1)  # Triton's interpreter (a CPU's tensors: tests): small tiles are fast there


def mode() -> Mode:
    """``RAGKV_ATTENTION_KERNEL`` (read each call): ``auto`` (default), ``on`` (1) or ``off`` (0)."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw == "auto":
        return "auto"
    if raw in ("1", "on", "true"):
        return "on"
    if raw in ("0", "off", "false"):
        return "off"
    raise ValueError(
        f"{ENV} must be auto (time ragkv's attention kernel against SDPA once and keep the faster), "
        f"1 (use it wherever it passes its check) or 0, got {raw!r}"
    )


@functools.cache
def _kernel(interpret: bool) -> object:
    """The jitted kernel: compiled for the GPU, or run by Triton's interpreter (a CPU's tensors: tests)."""
    import triton
    from triton import knobs

    from ragkv.gpu._triton_attention import position_attention as source

    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        # rows and the scale change with every call: not specialized (a kind of their own would compile
        # in the middle of a request). Strides are: multiples of 16 wherever fusion calls it.
        return triton.jit(source, do_not_specialize=["rows", "scale"])


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`position_attention` computes this call: ``query`` ``[1, Hq, q, D]`` and
    ``key``/``value`` ``[1, Hkv, slots, D]`` in one half-precision dtype (bf16 or fp16) with unit
    stride along ``D`` (64 or 128), ``Hq`` a multiple of ``Hkv``, and ``positions`` ``[q]`` int64,
    contiguous, all on one device."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape or query.shape[0] != 1 or key.shape[0] != 1:
        return False
    (_, hq, q, d), (_, hkv, _, kd) = query.shape, key.shape
    if d not in _HEAD_DIMS or kd != d or hkv == 0 or hq % hkv:
        return False
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if any(t.stride(3) != 1 or t.device != query.device for t in (key, value, query)):
        return False
    return (
        positions.shape == (q,)
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and (positions.device == query.device)
    )


def position_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Attention of queries at slots ``positions`` over the slots up to each one's own: ``[1, q, Hq, D]``
    in the query's dtype, as transformers' attention functions return it. Call only where :func:`fits`
    says so, with every position in ``[0, slots)`` (the caller knows them on the host; the kernel
    does not check). ``scale``: the softmax scale (None: ``D ** -0.5``). On a CPU tensor it runs in
    Triton's interpreter (tests)."""
    if not fits(query, key, value, positions):
        got = f"{tuple(query.shape)} {query.dtype}, {tuple(key.shape)} {key.dtype}, {tuple(positions.shape)}"
        raise ValueError(
            "position_attention takes [1, Hq, q, D] queries and [1, Hkv, slots, D] keys and values in bf16 "
            f"or fp16 (D 64 or 128, unit stride along it) and [q] int64 positions on their device; got {got}"
        )
    _, hq, rows, d = query.shape
    hkv = key.shape[1]
    out = torch.empty((1, rows, hq, d), dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    interpret = query.device.type != "cuda"
    cfg = config or (_INTERPRETED if interpret else _CUDA_CONFIGS[0])
    sm_scale = float(scale) if scale is not None else d**-0.5
    on_device = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
    with on_device:  # Triton launches on the current device: the tensors' one
        _kernel(interpret)[(-(-rows // cfg.block_m), hq)](  # type: ignore[index]
            query,
            key,
            value,
            positions,
            out,
            rows,
            query.stride(1),
            query.stride(2),
            key.stride(1),
            key.stride(2),
            value.stride(1),
            value.stride(2),
            out.stride(1),
            sm_scale * _LOG2E,
            GROUP=hq // hkv,
            D=d,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            ALL_SLOTS=key.shape[2] if interpret else 0,
            WIDEN=interpret and query.dtype == torch.bfloat16,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out


def masked_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """What a fused pass computes through torch for the same call (``ragkv.model.attention.fused_pass_attention``:
    SDPA with the exact causal mask in the inputs' dtype), ``[1, q, Hq, D]``. With fp32 inputs, the
    reference :func:`_check` measures the kernel and SDPA against."""
    mask = PositionMask(positions.cpu(), key.shape[2], query.dtype, query.device, device_pos=positions)
    return fused_pass_attention(query, key, value, mask, scale)


# Devices fusion may use the kernel on (the tests add "cpu": Triton's interpreter).
_DEVICES: tuple[str, ...] = ("cuda",)
_Key = tuple[torch.device, torch.dtype, int, int, int, str]
_CHOICES: dict[_Key, Config | None] = {}
_LOCK = threading.Lock()


def attention_kernel(adapter: ModelAdapter) -> PositionKernel | None:
    """The kernel as fusion's :class:`~ragkv.model.masks.PositionMask` kernel for ``adapter``'s model, or
    None where fusion's attention goes through torch: not a GPU, Triton missing, ``RAGKV_TRITON=0`` or
    ``RAGKV_ATTENTION_KERNEL=0``, its check failed on this device, or (``auto``) SDPA was faster.
    Decided once per device, dtype and head layout (:func:`_choose`). A launch that fails in a
    request sends that call and later ones through torch (logged). Wrong settings raise ValueError."""
    if adapter.device.type not in _DEVICES or not kernels.enabled():
        return None
    how = mode()
    s = adapter.spec
    if how == "off" or adapter.dtype not in (torch.bfloat16, torch.float16) or s.head_dim not in _HEAD_DIMS:
        return None
    key: _Key = (adapter.device, adapter.dtype, s.num_heads, s.num_kv_heads, s.head_dim, how)
    with _LOCK:
        if key not in _CHOICES:
            _CHOICES[key] = _choose(adapter.device, adapter.dtype, s.num_heads, s.num_kv_heads, s.head_dim, how)
        cfg = _CHOICES[key]
    if cfg is None:
        return None

    def run(
        query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float | None
    ) -> torch.Tensor | None:
        if _CHOICES.get(key) is None or not fits(query, k, v, positions):
            return None
        try:
            return position_attention(query, k, v, positions, scale, cfg)
        except Exception as e:  # Triton's own errors included: this call and later ones go through torch
            logger.warning("ragkv's Triton attention kernel failed (%s): fusion's attention goes through torch", e)
            with _LOCK:
                _CHOICES[key] = None
            return None

    return run


def _choose(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int, how: Mode) -> Config | None:
    """The tiles to launch the kernel with on ``device`` for this head layout, or None to keep torch.

    Each candidate tiling must pass :func:`_check`; ``on`` takes the first that does. ``auto`` times
    those that do on a recompute-like call (:func:`_timing_inputs`: a fifth of 8,192 slots'
    rows spread over the context, as a recompute's first layers run them) against what fusion runs
    without the kernel for it (``ragkv.model.attention.fused_pass_attention``: SDPA with the mask, the
    key and value heads shared where torch has a fused kernel for that), and keeps the kernel only
    where it is faster."""
    configs = _CUDA_CONFIGS if device.type == "cuda" else (_INTERPRETED,)
    passed = [c for c in configs if _check(device, dtype, heads, kv_heads, d, c)]
    if not passed:
        return None
    if how == "on":
        return passed[0]
    q, k, v, pos = _timing_inputs(device, dtype, heads, kv_heads, d)
    mask = PositionMask(pos.cpu(), k.shape[2], dtype, device, device_pos=pos)  # made once, as fusion's layers share it
    sdpa_s = _seconds(lambda: fused_pass_attention(q, k, v, mask), device)
    timed = {c: _seconds(functools.partial(position_attention, q, k, v, pos, None, c), device) for c in passed}
    best = min(timed, key=lambda c: timed[c])
    what = ", ".join(
        f"{c.block_m}x{c.block_n}/{c.num_warps}w/{c.num_stages}s {t * 1e3:.2f} ms" for c, t in timed.items()
    )
    take = timed[best] < sdpa_s
    logger.info(
        "ragkv's attention kernel on %s (%s, %d/%d heads, D %d), %d rows over %d slots: %s; SDPA with the mask "
        "%.2f ms: fusion's attention %s",
        device,
        dtype,
        heads,
        kv_heads,
        d,
        q.shape[2],
        k.shape[2],
        what,
        sdpa_s * 1e3,
        "uses the kernel" if take else "stays with torch",
    )
    return best if take else None


# A recompute-like timing call: its rows a fifth of the slots, spread over them (the choice's shape).
_TIMING_SLOTS = 8192
_TIMING_SHARE = 5


def _timing_inputs(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = _TIMING_SLOTS
    gen = torch.Generator().manual_seed(0)
    pos = torch.sort(torch.randperm(slots, generator=gen)[: slots // _TIMING_SHARE]).values
    q = torch.randn((1, pos.numel(), heads, d), generator=gen).to(dtype).to(device).transpose(1, 2)
    k = torch.randn((1, kv_heads, slots, d), generator=gen).to(dtype).to(device)
    v = torch.randn((1, kv_heads, slots, d), generator=gen).to(dtype).to(device)
    return q, k, v, pos.to(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """The median of ``repeats`` timed calls after one untimed (compiles, allocator warm)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int, config: Config) -> bool:
    """The kernel with ``config`` against an fp32 reference on ``device``: True where its largest error is
    within twice SDPA's own on the same half-precision inputs (plus one ulp of the output's scale).
    Rows in no order, the first and last slot among them, more rows than one tile and fewer than two,
    keys in a buffer longer than the slots. False (logged) where it differs or fails to compile or run."""
    gen = torch.Generator().manual_seed(0)
    slots, rows = 203, config.block_m + 5
    pos = torch.cat([torch.tensor([slots - 1, 0]), torch.randint(0, slots, (rows - 2,), generator=gen)])
    q = torch.randn((1, rows, heads, d), generator=gen).to(dtype).to(device).transpose(1, 2)
    buf = torch.randn((2, 1, kv_heads, slots + 29, d), generator=gen).to(dtype).to(device)
    k, v = buf[0, :, :, :slots], buf[1, :, :, :slots]
    dev_pos = pos.to(device)
    want = masked_reference(q.float(), k.float(), v.float(), dev_pos, None)
    sdpa_err = (masked_reference(q, k, v, dev_pos, None).float() - want).abs().max().item()
    try:
        got = position_attention(q, k, v, dev_pos, None, config)
    except Exception as e:  # a Triton that cannot compile these tiles for this device, say
        logger.warning("ragkv's Triton attention kernel (%s) failed on %s: %s", config, device, e)
        return False
    err = (got.float() - want).abs().max().item()
    bound = 2 * sdpa_err + torch.finfo(dtype).eps * want.abs().max().item()
    if not err <= bound:  # NaN fails too
        logger.info(
            "ragkv's Triton attention kernel (%s) is off by %.3g on %s (SDPA by %.3g): not used",
            config,
            err,
            device,
            sdpa_err,
        )
        return False
    return True
