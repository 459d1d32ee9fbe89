"""Fusion's recompute attention on a GPU, computed from the rows' positions by a Triton kernel.

A fused pass runs rows at scattered slots of the cache: the row at slot ``p`` sees the slots up to
``p``. Through torch that needs the mask as a tensor (``ragkv.model.masks.PositionMask``), made a
block of rows at a time at long contexts, and SDPA with an arbitrary mask computes every slot its
block covers: at 16K tokens of Llama-3.1-8B's shape the recompute's attention took 84 ms on an
H100, the largest part of the recompute (docs/benchmarks.md, "GPU"), and its masks move 7.4 GB.
:func:`position_attention` is a flash kernel that reads each row's position instead: no mask, and
each tile of rows walks the key slots only up to its last row's position (what the CPU's native
kernel, ``ragkv.model.native_attention``, does there). At Llama-3.1-8B's shape a default fusion's
recompute attention then does 0.66 of the work of SDPA with fusion's masks at 16K tokens and 0.91
at 32K, where the masks' blocks of rows already cut most of it; within 7% of the causal minimum
(``experiments/attention_work.py``).

It is within rounding of SDPA's output, not bit for bit (a flash kernel orders its sums by tile,
as SDPA's own kernels do, differently): checked on each device against an fp32 reference, with
an error bound set by what SDPA itself makes on the same inputs (:func:`_check`).

Whether fusion uses it (:func:`attention_kernel`), per device, dtype and head layout:
``RAGKV_ATTENTION_KERNEL`` ``auto`` (the default) times it against SDPA with the mask on two
recompute-like calls and keeps it where faster (:func:`_choose`, once; logged); ``1`` uses it
wherever it passes the check; ``0`` never. ``RAGKV_TRITON=0`` switches it off with ragkv's other kernels.
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

__all__ = [
    "ENV",
    "PROFILED_NAME",
    "Config",
    "attention_kernel",
    "fits",
    "masked_reference",
    "mode",
    "position_attention",
]

ENV = "RAGKV_ATTENTION_KERNEL"
PROFILED_NAME = "ragkv::position_attention"  # the kernel's launches, as torch's profiler lists them
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


# Tried on a GPU by the timed choice; where it is not timed (``1``), the first that passes its check.
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
        # rows and the scale change with every call: not specialized (a row count of 1, or one divisible
        # by 16, would be a kind of its own, compiled in the middle of a request). The strides are: what
        # Triton specializes on is their divisibility by 16 (it lets the loads vectorize), which every
        # call has (multiples of head_dim), so one compiled kernel serves them all.
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
    with on_device, kernels.profiled(PROFILED_NAME):  # Triton launches on the current device: the tensors' one
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
            INTERPRET=interpret,
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
_LOCK = threading.Lock()  # guards _CHOICES and _KEY_LOCKS; a key's choice is made under its own lock
_KEY_LOCKS: dict[_Key, threading.Lock] = {}
_OOM_UNTIL: dict[_Key, float] = {}  # a choice that ran out of device memory is tried again after this
_OOM_RETRY_S = 30.0


def attention_kernel(adapter: ModelAdapter) -> PositionKernel | None:
    """The kernel as fusion's :class:`~ragkv.model.masks.PositionMask` kernel for ``adapter``'s model, or
    None where fusion's attention goes through torch: not a GPU, Triton missing, ``RAGKV_TRITON=0`` or
    ``RAGKV_ATTENTION_KERNEL=0``, its check failed on this device, or (``auto``) SDPA was faster.
    Decided once per device, dtype and head layout (:func:`_choose`); a choice that runs out of
    device memory keeps torch and is tried again 30 s later, any other failure keeps torch (logged).
    The kernel then takes calls of that dtype, head layout and device only. A launch that fails in a
    request sends that call and later ones through torch (out of memory: that call only; logged).
    Wrong settings raise ValueError."""
    if adapter.device.type not in _DEVICES or not kernels.enabled():
        return None
    how = mode()
    s = adapter.spec
    if how == "off" or adapter.dtype not in (torch.bfloat16, torch.float16) or s.head_dim not in _HEAD_DIMS:
        return None
    key: _Key = (adapter.device, adapter.dtype, s.num_heads, s.num_kv_heads, s.head_dim, how)
    cfg = _choice(key)
    if cfg is None:
        return None
    layout, dtype = (s.num_heads, s.num_kv_heads, s.head_dim), adapter.dtype
    device_index = adapter.device.index if adapter.device.index is not None else _current_index(adapter.device)

    def run(
        query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float | None
    ) -> torch.Tensor | None:
        if _CHOICES.get(key) is None or (query.shape[1], k.shape[1], query.shape[3]) != layout:
            return None  # another head layout would compile, unchecked, in the middle of a request
        if query.dtype != dtype or query.device != positions.device or not fits(query, k, v, positions):
            return None
        if query.device.type == "cuda" and query.device.index not in (None, device_index):
            return None  # a model split over GPUs: the others were not checked
        try:
            return position_attention(query, k, v, positions, scale, cfg)
        except Exception as e:  # Triton's own errors included: this call and later ones go through torch
            if _is_oom(e):  # this call only: torch's path for it may still fit
                logger.warning("ragkv's Triton attention kernel ran out of device memory: this call goes through torch")
                return None
            logger.warning("ragkv's Triton attention kernel failed (%s): fusion's attention goes through torch", e)
            with _LOCK:
                _CHOICES[key] = None
            return None

    return run


def _current_index(device: torch.device) -> int | None:
    """The index a device named without one stands for (CUDA's current device), None elsewhere."""
    return torch.cuda.current_device() if device.type == "cuda" else None


def _choice(key: _Key) -> Config | None:
    """The choice for ``key``, made once by the first thread to ask; a thread that asks while another is
    making it goes through torch meanwhile (a choice compiles and times for a second or two). After
    running out of device memory it is tried again 30 s later, and only with room for its timing calls
    (:data:`_CHOICE_ROOM` free on the device): its temporaries are not taken beside a full device."""
    with _LOCK:
        if key in _CHOICES:
            return _CHOICES[key]
        retry = key in _OOM_UNTIL
        if retry and _now() < _OOM_UNTIL[key]:
            return None
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    device, dtype, heads, kv_heads, d, how = key
    if retry and device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < _CHOICE_ROOM:
        with _LOCK:
            _OOM_UNTIL[key] = _now() + _OOM_RETRY_S
        return None
    if not lock.acquire(blocking=False):
        return None
    try:
        with _LOCK:
            if key in _CHOICES:  # made by another thread meanwhile
                return _CHOICES[key]
        try:
            cfg = _choose(device, dtype, heads, kv_heads, d, how)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - a choice that cannot be made keeps torch; the request goes on
            if _is_oom(e):
                logger.warning(
                    "ragkv's attention kernel: out of device memory while checking it on %s (%s); fusion's "
                    "attention goes through torch, and the kernel is tried again in %.0f s",
                    device,
                    e,
                    _OOM_RETRY_S,
                )
                with _LOCK:
                    _OOM_UNTIL[key] = _now() + _OOM_RETRY_S
                return None
            logger.warning("ragkv's attention kernel could not be checked on %s (%s): fusion keeps torch", device, e)
            cfg = None
        with _LOCK:
            _CHOICES[key] = cfg
        return cfg
    finally:
        lock.release()


def _now() -> float:
    """The clock the retries after running out of memory are timed by (monotonic seconds)."""
    return time.monotonic()


_CHOICE_ROOM = 2 << 30  # bytes free on the device for a retried choice's timing calls (they take up to ~1 GB)


def _is_oom(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory: torch's error, or Triton's, cuBLAS' or cuDNN's
    (plain RuntimeErrors naming it)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _choose(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int, how: Mode) -> Config | None:
    """The tiles to launch the kernel with on ``device`` for this head layout, or None to keep torch.

    Each candidate tiling must pass :func:`_check`; ``on`` takes the first that does. ``auto`` times
    those that do on two recompute-like calls (:data:`_TIMING_SHAPES`: a fifth of 8,192 and of
    32,768 slots' rows spread over them, as a recompute's first layers run them; the second's mask
    is made by blocks of rows, as at long contexts) against what fusion runs for them without the
    kernel (``ragkv.model.attention.fused_pass_attention``: SDPA with the mask, the key and value
    heads shared where torch has a fused kernel for that; a model whose attention is the modeling
    file's eager one would be slower still), and keeps the tiling whose time over SDPA's has the
    least geometric mean over the two shapes (each counts alike: the longer call's time would
    decide a sum), where that mean is under 1."""
    configs = _CUDA_CONFIGS if device.type == "cuda" else (_INTERPRETED,)
    if how == "on":  # the first tiling that passes: no other is compiled
        return next((c for c in configs if _check(device, dtype, heads, kv_heads, d, c)), None)
    passed = [c for c in configs if _check(device, dtype, heads, kv_heads, d, c)]
    if not passed:
        return None
    ratios: dict[Config, list[float]] = {c: [] for c in passed}  # the kernel's time over SDPA's, per shape
    shown = []
    for rows, slots in _TIMING_SHAPES:
        q, k, v, pos = _timing_inputs(device, dtype, heads, kv_heads, d, rows, slots)
        mask = PositionMask(pos.cpu(), slots, dtype, device, device_pos=pos)  # made once: fusion's layers share it
        sdpa_s = _seconds(functools.partial(fused_pass_attention, q, k, v, mask), device)
        times = []
        for c in passed:
            t = _seconds(functools.partial(position_attention, q, k, v, pos, None, c), device)
            ratios[c].append(t / sdpa_s)
            times.append(f"{c.block_m}x{c.block_n}/{c.num_warps}w/{c.num_stages}s {t * 1e3:.2f}")
        shown.append(f"{rows} rows over {slots} slots: SDPA with the mask {sdpa_s * 1e3:.2f} ms, {', '.join(times)}")
    score = {c: statistics.geometric_mean(r) for c, r in ratios.items()}  # each shape counts alike
    best = min(score, key=lambda c: score[c])
    take = score[best] < 1
    logger.info(
        "ragkv's attention kernel on %s (%s, %d/%d heads, D %d): %s; the best tiling takes %.2f of SDPA's time "
        "(geometric mean over the shapes): fusion's attention %s",
        device,
        dtype,
        heads,
        kv_heads,
        d,
        "; ".join(shown),
        score[best],
        "uses the kernel" if take else "stays with torch",
    )
    return best if take else None


# Recompute-like timing calls, (rows, slots): rows a fifth of the slots, spread over them.
_TIMING_SHAPES = ((1638, 8192), (6553, 32768))


def _timing_inputs(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int, rows: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    pos = torch.sort(torch.randperm(slots, generator=gen)[:rows]).values
    q = torch.randn((1, rows, heads, d), generator=gen).to(dtype).to(device).transpose(1, 2)
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


def rounding_excess(
    got: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
) -> float:
    """How far ``got`` (the kernel's output for the call) is from an fp32 reference, row by row, in units of
    what rounding allows that row: its error over twice SDPA's own error on the same half-precision
    inputs plus one ulp of the row's largest output. At most 1 is within rounding; NaN for a NaN.
    Row by row, so that a long row's error is not hidden by a short row's larger outputs."""
    want = masked_reference(query.float(), key.float(), value.float(), positions)  # [1, q, Hq, D]
    sdpa = masked_reference(query, key, value, positions).float()

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.abs().amax(dim=(0, 2, 3))

    allowed = 2 * per_row(sdpa - want) + torch.finfo(query.dtype).eps * per_row(want)
    return float((per_row(got.float() - want) / allowed).max())


def _check_positions(rows: int, slots: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Two sets of query slots: in no order with the first and last slot among them, and as a recompute
    has them, distinct and sorted (its first tiles end after a step or two over the keys)."""
    scattered = torch.cat([torch.tensor([slots - 1, 0]), torch.randint(0, slots, (rows - 2,), generator=gen)])
    recompute = torch.sort(torch.randperm(slots, generator=gen)[:rows]).values
    return [scattered, recompute]


def _check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int, config: Config) -> bool:
    """The kernel with ``config`` against an fp32 reference on ``device``: True where every row is within
    rounding (:func:`rounding_excess` at most 1). More rows than one tile and fewer than two, keys in a
    buffer longer than the slots, the slots of :func:`_check_positions`. False (logged) where it
    differs or fails to compile or run."""
    gen = torch.Generator().manual_seed(0)
    rows = config.block_m + 5
    slots = 2 * rows + 7
    q = torch.randn((1, rows, heads, d), generator=gen).to(dtype).to(device).transpose(1, 2)
    buf = torch.randn((2, 1, kv_heads, slots + 29, d), generator=gen).to(dtype).to(device)
    k, v = buf[0, :, :, :slots], buf[1, :, :, :slots]
    for pos in _check_positions(rows, slots, gen):
        dev_pos = pos.to(device)
        try:
            got = position_attention(q, k, v, dev_pos, None, config)
        except Exception as e:  # a Triton that cannot compile these tiles for this device, say
            if _is_oom(e):
                raise  # no verdict on the kernel: the choice is tried again later
            logger.warning("ragkv's Triton attention kernel (%s) failed on %s: %s", config, device, e)
            return False
        excess = rounding_excess(got, q, k, v, dev_pos)
        if not excess <= 1:  # NaN fails too
            logger.info(
                "ragkv's Triton attention kernel (%s) is off by %.3g times rounding on %s: not used",
                config,
                excess,
                device,
            )
            return False
    return True
