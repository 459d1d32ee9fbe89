"""Where and in what precision the model runs: the ``device`` and ``dtype`` settings and their ``auto`` rules."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ragkv.model.quant import available_formats

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICES",
    "DTYPES",
    "cpu_has_native_bf16",
    "dtype_name",
    "dtype_reason",
    "resolve_decode_weights",
    "resolve_device",
    "resolve_dtype",
    "validate_placement",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")  # for messages
# ``decode_weights="auto"`` picks the int8 copy for a GGUF file whose decoder matrices are stored in at
# most this many bits: there one more (per-row int8) rounding adds 1/90-1/125 of the KL that one more
# rounding of the file's own kind adds (experiments/decode_weight_error.py, docs/benchmarks.md).
INT8_DECODE_MAX_FILE_BITS = 8


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo.

    Without it bf16 matmuls are emulated and slower than fp32 (docs/benchmarks.md, "dtype on CPU").
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to tell, stay in fp32
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (or None): CUDA if available, then MPS, else CPU; ``cpu``, ``cuda``, ``cuda:N``, ``mps`` as given."""
    if isinstance(device, torch.device):
        return device
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device {device!r}; use one of {', '.join(DEVICES)}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but torch sees no CUDA device; use device='cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The weights' dtype: ``auto`` is bf16 on CUDA (fp16 where bf16 is unsupported) and on CPUs with
    native bf16, fp16 on MPS, else fp32; a name (float32, bfloat16, float16) as given; None keeps
    whatever the checkpoint loader picks."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name stats, /health and bench tables show."""
    return str(dtype).removeprefix("torch.")


def dtype_reason(requested: str | torch.dtype | None, device: torch.device) -> str:
    """Why the weights run in the dtype :func:`resolve_dtype` picks for ``requested``, in a few words.

    Shown beside every figure, since the same model is ~2x faster in bf16 on a CPU with native bf16
    and numbers from machines with and without it must not be compared as if alike.
    """
    if requested is None:
        return "the checkpoint's dtype"
    if isinstance(requested, torch.dtype) or requested != "auto":
        return "asked for"
    if device.type in ("cuda", "mps"):
        return f"auto: {device.type}"
    if cpu_has_native_bf16():
        return "auto: this CPU has native bf16 matmuls"
    return "auto: this CPU has no native bf16 matmuls"


def validate_placement(dtype: str, device: str) -> None:
    """Raise ValueError for a dtype or device name the settings do not know (before any model loads)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")


def resolve_decode_weights(
    requested: str,
    device: torch.device,
    weight_bits: int | None,
    timer: Callable[[Sequence[str]], dict[str, float]] | None = None,
) -> tuple[str, str]:
    """The weights decode steps read, and why: ``requested`` unless it is ``auto``.

    ``auto`` decodes with a copy on the CPU for a GGUF file stored in at most
    :data:`INT8_DECODE_MAX_FILE_BITS` bits (its own rounding dwarfs the copy's), else with the
    model's weights. The copy is ``int8``, or whichever of ``int8`` and ``fp16`` (both far
    smaller errors than the file's: docs/benchmarks.md) ``timer`` measures fastest on this CPU
    (``ragkv.model.quant.time_formats``; None: int8).
    """
    if requested != "auto":
        return requested, "asked for"
    if device.type != "cpu":
        return "model", f"auto: the int8 copy runs on CPU kernels, not on {device.type}"
    if weight_bits is None:
        return "model", "auto: not a quantized GGUF file"
    if weight_bits > INT8_DECODE_MAX_FILE_BITS:
        return "model", f"auto: the file stores {weight_bits}-bit weights"
    why = f"auto: the file stores weights in {weight_bits} bits or fewer, a copy adds far less error"
    candidates = [f for f in ("int8", "fp16") if f in available_formats()]
    if timer is None or len(candidates) < 2:
        return "int8", why
    times = timer(candidates)
    best = min(candidates, key=lambda f: times[f])
    shown = ", ".join(f"{f} {times[f]:.2f} ms" for f in candidates)
    return best, f"{why}; {best} measured fastest here ({shown} for a 1-row and a 4-row step of 4 layers' MLPs)"
