"""A weight-only int8 matrix product for decode steps, in C for x86 CPUs with AVX2 and FMA.

torch's int8 kernel (``torch._weight_int8pack_mm``) takes bf16 activations; on a CPU without
native bf16 (AVX2 only) it is bound by its arithmetic, not by the bytes it reads. This kernel
reads the same int8 rows and per-row scales, widens 8 weights at a time to fp32 and multiplies
them with fp32 activations (more precise than the bf16 the torch kernel takes):
``y[r, o] = scales[o] * sum_i x[r, i] * q[o, i]``. Each weight row is one sequential read (on a
2-core AMD EPYC, one stream a thread read memory twice as fast as four interleaved rows), used for
four activation rows at a time (then two, then one). Output rows are split over torch's own
OpenMP threads: the library links the ``libgomp.so.1`` torch loaded, so there is one thread pool,
sized by ``torch.get_num_threads()``. All of Qwen2.5 0.5B's int8 matrices, streamed from memory
as a one-row decode step reads them: 34 ms here against torch's 56 ms
(``experiments/decode_steps.py --kernels``).

It is compiled on first use with the system's C compiler (``cc``, about a second) into
``~/.cache/ragkv/kernels/`` (``RAGKV_KERNEL_CACHE`` overrides), named by a digest of its source,
flags and compiler, and loaded with ctypes. Where there is no compiler, the CPU lacks AVX2/FMA,
the build fails, or ``RAGKV_NATIVE_KERNELS=0``, :func:`int8_library` returns None (the reason is
logged once) and callers keep torch's kernel. :class:`NativeLibrary` is that build and load, for
this kernel and :mod:`ragkv.model.native_attention`'s.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import profiler as _profiler

logger = logging.getLogger(__name__)

__all__ = [
    "INT8",
    "NATIVE_MAX_ROWS",
    "NativeLibrary",
    "PROFILED_NAME",
    "int8_available",
    "int8_kernel",
    "int8_library",
    "int8_matmul",
    "kernel_cache_dir",
    "profiled_call",
]

PROFILED_NAME = "ragkv::int8_matmul"  # the kernel's calls, as torch's profiler lists them
NATIVE_MAX_ROWS = 16  # activation rows the kernel takes (a decode batch); more go to torch's kernel

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

int ragkv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 widen(__m128i w) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w)); }

/* The dot products of the weight row qo with activation rows x0 and, when two, x1. Inlined with a
   constant `two`, so each case is its own loop. 32 weights (one load) a step, four accumulators. */
static inline void dot(const float *x0, const float *x1, const int two, const int8_t *qo, int64_t in,
                       float *s0, float *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t body = in - in % 32;
    for (int64_t i = 0; i < body; i += 32) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(qo + i));
        __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
        __m256 w0 = widen(lo), w1 = widen(_mm_srli_si128(lo, 8)), w2 = widen(hi), w3 = widen(_mm_srli_si128(hi, 8));
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + i + 8), a1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + i + 16), a2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + i + 24), a3);
        if (two) {
            b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + i), b0);
            b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i + 8), b1);
            b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + i + 16), b2);
            b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + i + 24), b3);
        }
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    float t = two ? hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3))) : 0.0f;
    for (int64_t i = body; i < in; i++) {
        s += x0[i] * qo[i];
        if (two) t += x1[i] * qo[i];
    }
    *s0 = s;
    *s1 = t;
}

/* The dot products of the weight row qo with four activation rows x..x+3*in: each weight widened
   once for the four (16 weights a step, eight accumulators). */
static inline void dot4(const float *x, const int8_t *qo, int64_t in, float *s) {
    __m256 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
    int64_t body = in - in % 16;
    for (int64_t i = 0; i < body; i += 16) {
        __m128i w = _mm_loadu_si128((const __m128i *)(qo + i));
        __m256 w0 = widen(w), w1 = widen(_mm_srli_si128(w, 8));
        for (int r = 0; r < 4; r++) {
            a[2 * r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * in + i), a[2 * r]);
            a[2 * r + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * in + i + 8), a[2 * r + 1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        s[r] = hsum(_mm256_add_ps(a[2 * r], a[2 * r + 1]));
        for (int64_t i = body; i < in; i++) s[r] += x[r * in + i] * qo[i];
    }
}

/* y [rows, out] = x [rows, in] @ (q [out, in] * scales [out, 1]).T, all row-major and contiguous.
   Threads split the output rows; each weight row is read from memory once, for every activation
   row (four, two or one at a time while it sits in L1). */
void ragkv_int8_matmul(const float *x, const int8_t *q, const float *scales, float *y,
                       int64_t rows, int64_t in, int64_t out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *qo = q + o * in;
        float u, v, f[4];
        int64_t r = 0;
        for (; r + 3 < rows; r += 4) {
            dot4(x + r * in, qo, in, f);
            for (int k = 0; k < 4; k++) y[(r + k) * out + o] = f[k] * scales[o];
        }
        for (; r + 1 < rows; r += 2) {
            dot(x + r * in, x + (r + 1) * in, 1, qo, in, &u, &v);
            y[r * out + o] = u * scales[o];
            y[(r + 1) * out + o] = v * scales[o];
        }
        if (r < rows) {
            dot(x + r * in, x + r * in, 0, qo, in, &u, &v);
            y[r * out + o] = u * scales[o];
        }
    }
}
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def kernel_cache_dir() -> Path:
    """Where compiled kernels live: ``RAGKV_KERNEL_CACHE``, else ``~/.cache/ragkv/kernels``."""
    env = os.environ.get("RAGKV_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ragkv" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


class NativeLibrary:
    """A C source compiled on first use into :func:`kernel_cache_dir` and loaded with ctypes, once per process.

    ``name`` names the file (with a digest of the source, flags and compiler); the source defines
    ``int ragkv_supported(void)`` (whether this CPU runs it); ``declare`` sets the ctypes
    signatures. ``what`` and ``fallback`` word the log lines ("native int8 kernel", "torch's int8
    kernel decodes"). :meth:`get` returns None where it cannot run: ``RAGKV_NATIVE_KERNELS=0``, not
    an x86 Linux CPU with one of ``isa`` (torch's CPU capability), no compiler, a failed build, or
    ``ragkv_supported()`` false; the reason is logged once.
    """

    def __init__(
        self,
        name: str,
        source: str,
        flags: list[str],
        *,
        what: str,
        fallback: str,
        isa: tuple[str, ...],
        declare: Callable[[ctypes.CDLL], None],
    ) -> None:
        self.name, self.source, self.flags = name, source, flags
        self.what, self.fallback, self.isa, self.declare = what, fallback, isa, declare
        self._lock = threading.Lock()
        self._library: list[ctypes.CDLL | None] = []  # [] until the first look, then [library or None]

    def build(self, compiler: str, again: bool = False) -> Path:
        """The compiled library's path, compiled unless the cache has it (``again``: recompile anyway)."""
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=False, timeout=60
        ).stdout
        digest = hashlib.sha256("\0".join([self.source, *self.flags, version]).encode()).hexdigest()[:20]
        target = kernel_cache_dir() / f"ragkv_{self.name}_{digest}.so"
        if target.exists() and not again:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            source = Path(work) / f"{self.name}.c"
            source.write_text(self.source)
            built = Path(work) / target.name
            done = subprocess.run(
                [compiler, *self.flags, str(source), "-o", str(built)],
                capture_output=True,
                text=True,
                check=False,
                timeout=300,
            )
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip()[-2000:] or f"{compiler} exited {done.returncode}")
            os.replace(built, target)  # atomic: a concurrent build leaves one whole file
        return target

    def _load(self) -> ctypes.CDLL | None:
        if os.environ.get("RAGKV_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
            logger.info("%s off (RAGKV_NATIVE_KERNELS); %s", self.what, self.fallback)
            return None
        if sys.platform != "linux" or not torch.backends.cpu.get_cpu_capability().startswith(self.isa):
            logger.info("%s: not an x86 Linux CPU with %s; %s", self.what, " or ".join(self.isa), self.fallback)
            return None
        compiler = _compiler()
        if compiler is None:
            logger.info("%s: no C compiler (cc); %s", self.what, self.fallback)
            return None
        torch_lib = Path(torch.__file__).parent / "lib"
        try:
            # torch's own libgomp first, so the kernel's OpenMP calls share torch's thread pool
            for gomp in sorted(torch_lib.glob("libgomp*.so*")):
                ctypes.CDLL(str(gomp), mode=ctypes.RTLD_GLOBAL)
                break
            path = self.build(compiler)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # a damaged file in the cache (a full disk, a copy cut short): built anew, once
                path = self.build(compiler, again=True)
                lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("%s could not be built or loaded (%s); %s", self.what, e, self.fallback)
            return None
        if not lib.ragkv_supported():
            logger.info("%s: this CPU lacks the instructions it needs; %s", self.what, self.fallback)
            return None
        self.declare(lib)
        logger.info("%s loaded from %s", self.what, path)
        return lib

    def get(self) -> ctypes.CDLL | None:
        """The compiled library, built and loaded once per process; None where it cannot run."""
        with self._lock:
            if not self._library:
                self._library.append(self._load())
            return self._library[0]


def profiled_call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; while torch's profiler records, it lists the call as ``name``."""
    if _profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


def _declare_int8(lib: ctypes.CDLL) -> None:
    fn = lib.ragkv_int8_matmul
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]


INT8 = NativeLibrary(
    "int8",
    _SOURCE,
    _FLAGS,
    what="native int8 kernel",
    fallback="torch's int8 kernel decodes",
    isa=("AVX2", "AVX512"),
    declare=_declare_int8,
)


def int8_library() -> ctypes.CDLL | None:
    """The compiled int8 kernel library, built and loaded once per process; None where it cannot run."""
    return INT8.get()


def int8_available() -> bool:
    """Whether :func:`int8_matmul` runs here (the kernel built and the CPU has AVX2 and FMA)."""
    return int8_library() is not None


def int8_kernel(q: torch.Tensor, scales: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> int8_matmul(x, q, scales)`` with the operands checked once, for a decode step's many calls."""
    lib = int8_library()
    if lib is None:
        raise RuntimeError("the native int8 kernel is not available here (see the log for why)")
    _check(q, scales)
    out, inp = q.shape
    fn, qp, sp = lib.ragkv_int8_matmul, q.data_ptr(), scales.data_ptr()

    def kernel(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        rows = x.shape[0]
        if x.dim() != 2 or x.shape[1] != inp:
            raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, weights [{out}, {inp}]")
        y = torch.empty(rows, out, dtype=torch.float32)
        profiled_call(PROFILED_NAME, fn, x.data_ptr(), qp, sp, y.data_ptr(), rows, inp, out, torch.get_num_threads())
        # q and scales stay alive with this closure: the pointers above stay valid
        return y

    kernel.operands = (q, scales)  # type: ignore[attr-defined]
    return kernel


def _check(q: torch.Tensor, scales: torch.Tensor) -> None:
    if q.dtype != torch.int8 or scales.dtype != torch.float32 or not (q.is_contiguous() and scales.is_contiguous()):
        raise ValueError("q must be contiguous int8 [out, in] and scales contiguous float32 [out]")
    if q.dim() != 2 or q.device.type != "cpu" or scales.shape != (q.shape[0],):
        shapes = f"{tuple(q.shape)} and {tuple(scales.shape)}"
        raise ValueError(f"q [out, in] on the CPU and scales [out] expected, got {shapes}")


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [rows, in] @ (q [out, in] int8 * scales [out] fp32).T`` in fp32, by the native kernel.

    ``q`` and ``scales`` must be contiguous CPU tensors; ``x`` is made contiguous fp32. Raises
    RuntimeError where the kernel is not available (check :func:`int8_available` first).
    """
    return int8_kernel(q, scales)(x)
