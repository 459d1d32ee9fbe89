"""Fusion's attention on a CPU: ragkv's own kernels, from the queries' positions instead of a mask.

A fused prefill recomputes tokens at scattered positions, each of which sees the slots up to its
own; torch's SDPA takes that as an additive ``[q, keys]`` mask, repeats K/V for grouped-query
heads, and runs at about a third of the matrix products' speed on such shapes (41% of a SmolLM2
fusion, ``experiments/fusion_profile.py``). These kernels take the queries' positions instead:

- bf16 (AVX-512 with AVX512-BF16): keys are packed once per call as bf16 pairs (the operand layout
  of ``vdpbf16ps``), values widened to fp32; the query heads of a KV head share them (no repeat);
- each work item (a KV head and 16 query tokens, its query heads as rows) computes its scores
  against the keys up to its last position only, as exact sums of bf16 products in fp32; the
  softmax (a Cephes polynomial for ``exp``), the product with V and the sums in fp32, the output
  rounded to bf16 once (torch's bf16 kernel rounds the probabilities to bf16 before that product);
- fp32 (AVX2 and FMA, where ``auto`` picks fp32): the same steps in fp32, keys packed by 8;
- the work items are spread over torch's own OpenMP threads (``torch.get_num_threads()``); with
  ``weights`` the kernel also sums each slot's probability over heads and queries (the question
  probe's record).

The bf16 kernel's output is the attention computed in fp64, rounded once, on nearly every element
(SDPA's on about 60%); the fp32 one is at fp32's own precision. Over SmolLM2's heads, 300 queries
and 1,535 keys: 2.5 ms against SDPA's 10.7 in bf16, 3.6 against 8.5 in fp32, on a 2-core AMD EPYC
with ``avx512_bf16`` (``python experiments/attention_cpu.py [--fp32]``; docs/benchmarks.md).

They are built like :mod:`ragkv.model.native`'s int8 kernel (``cc`` on first use, the kernel
cache, ``RAGKV_NATIVE_KERNELS=0`` turns them off). Where they cannot run, or a call asks for what
they do not compute (fp16, sliding windows, soft-capping, sinks, dropout, head sizes not a multiple
of 64 in bf16 or 16 in fp32), the call goes to the model's own attention with the mask, as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ragkv.model.native import NativeLibrary, profiled_call

__all__ = [
    "ATTENTION",
    "ATTENTION_FP32",
    "PROFILED_NAME",
    "attention_available",
    "scatter_applies",
    "scatter_attention",
]

PROFILED_NAME = "ragkv::scatter_attention"  # the kernel's calls, as torch's profiler lists them

# What both kernels' sources start with (each then says which CPUs run it).
_PREAMBLE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 64-byte aligned memory of at least n bytes (a whole number of 64-byte lines), or NULL */
static void *alloc64(int64_t n) { return aligned_alloc(64, (size_t)((n + 63) / 64 * 64)); }

#define QB 16 /* query tokens a work item takes (times the query heads of its KV head) */
"""

_SOURCE = (
    _PREAMBLE
    + r"""

int ragkv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}


/* e^x for x <= 0 (Cephes' single-precision polynomial, scaled by 2^n with scalef). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* Scores of four query rows (bf16 pairs, a 32-bit word each) against key tiles [t0, t1) of the
   packed keys (a tile: d/2 words for each of 16 keys, [i][key]); s[row][key] in fp32. */
static void scores4(const uint32_t *const qr[4], const uint32_t *kp, int64_t half, int64_t t0, int64_t t1,
                    float *s, int64_t ss) {
    int64_t t = t0;
    for (; t + 1 < t1; t += 2) {
        const uint32_t *k0 = kp + t * 16 * half, *k1 = k0 + 16 * half;
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < half; i++) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + i * 16), b1 = (__m512bh)_mm512_loadu_si512(k1 + i * 16);
            for (int r = 0; r < 4; r++) {
                __m512bh q = (__m512bh)_mm512_set1_epi32((int)qr[r][i]);
                a[2 * r] = _mm512_dpbf16_ps(a[2 * r], q, b0);
                a[2 * r + 1] = _mm512_dpbf16_ps(a[2 * r + 1], q, b1);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm512_storeu_ps(s + r * ss + t * 16, a[2 * r]);
            _mm512_storeu_ps(s + r * ss + t * 16 + 16, a[2 * r + 1]);
        }
    }
    if (t < t1) {
        const uint32_t *k0 = kp + t * 16 * half;
        __m512 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < half; i++) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + i * 16);
            for (int r = 0; r < 4; r++) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qr[r][i]), b0);
        }
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(s + r * ss + t * 16, a[r]);
    }
}

/* o[row][c..c+64) = P[row] @ V over keys [0, n), in fp32: p rows of probabilities, the values as
   fp32 rows [key][d]. */
static void values4(const float *const pr[4], const float *vf, int64_t d, int64_t c, int64_t n, float *const orow[4]) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
    for (int64_t key = 0; key < n; key++) {
        const float *v = vf + key * d + c;
        __m512 b0 = _mm512_loadu_ps(v), b1 = _mm512_loadu_ps(v + 16);
        __m512 b2 = _mm512_loadu_ps(v + 32), b3 = _mm512_loadu_ps(v + 48);
        for (int r = 0; r < 4; r++) {
            __m512 w = _mm512_set1_ps(pr[r][key]);
            a[4 * r] = _mm512_fmadd_ps(w, b0, a[4 * r]);
            a[4 * r + 1] = _mm512_fmadd_ps(w, b1, a[4 * r + 1]);
            a[4 * r + 2] = _mm512_fmadd_ps(w, b2, a[4 * r + 2]);
            a[4 * r + 3] = _mm512_fmadd_ps(w, b3, a[4 * r + 3]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(orow[r] + c + 16 * j, a[4 * r + j]);
}

/* Attention of nq queries at positions pos[] over the keys 0..pos (each query sees the slots up to
   its own), grouped-query heads (query head h reads KV head h / (hq / hkv)), bf16 in and out: the
   scores are exact sums of bf16 products in fp32, the softmax, the product with V and the sums in
   fp32, the output rounded to bf16 once. q: [hq][nq][d] by strides (qs_h, qs_t), k and v:
   [hkv][keys][d] by strides, the last dimension contiguous; out: [nq][hq][d] contiguous. d a
   multiple of 64. colsum (NULL: none): [keys] fp32, set to each key's probability summed over every
   head and query. Returns 0, -1 when out of memory, -2 when a position is not a key slot. */
int ragkv_scatter_attention(const uint16_t *q, int64_t qs_h, int64_t qs_t, const uint16_t *k, int64_t ks_h,
                            int64_t ks_t, const uint16_t *v, int64_t vs_h, int64_t vs_t, const int64_t *pos,
                            int64_t keys, uint16_t *out, float *colsum, int64_t hq, int64_t hkv, int64_t nq,
                            int64_t d, float scale, int threads) {
    int64_t maxpos = 0;
    for (int64_t t = 0; t < nq; t++) {
        if (pos[t] < 0 || pos[t] >= keys) return -2;
        maxpos = pos[t] > maxpos ? pos[t] : maxpos;
    }
    const int64_t nk = maxpos + 1, half = d / 2, groups = hq / hkv;
    const int64_t tiles = (nk + 31) / 32 * 2, width = tiles * 16;
    uint32_t *kp = (uint32_t *)alloc64(hkv * width * half * 4);
    float *vf = (float *)alloc64(hkv * nk * d * 4);
    if (!kp || !vf) {
        free(kp);
        free(vf);
        return -1;
    }
    /* pack: keys as [head][tile][i][16 keys] words of bf16 pairs (zero past nk), values as fp32 [head][key][d] */
    #pragma omp parallel for num_threads(threads) collapse(2) schedule(static) if (threads > 1)
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t t = 0; t < tiles; t++) {
            uint32_t *dst = kp + (h * tiles + t) * 16 * half;
            for (int64_t l = 0; l < 16; l++) {
                int64_t key = t * 16 + l;
                const uint32_t *src = (const uint32_t *)(k + h * ks_h + key * ks_t);
                for (int64_t i = 0; i < half; i++) dst[i * 16 + l] = key < nk ? src[i] : 0u;
                if (key >= nk) continue;
                const uint16_t *vs = v + h * vs_h + key * vs_t;
                float *row = vf + (h * nk + key) * d;
                for (int64_t c = 0; c < d; c += 16) {
                    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vs + c)));
                    _mm512_storeu_ps(row + c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
                }
            }
        }
    const int64_t blocks = (nq + QB - 1) / QB;
    int failed = 0;
    if (colsum) memset(colsum, 0, (size_t)keys * 4);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t rows_max = groups * QB + 3;
        float *s = (float *)alloc64(rows_max * width * 4);
        float *o = (float *)alloc64(rows_max * d * 4);
        float *lsum = (float *)alloc64(rows_max * 4);
        float *cs = colsum ? (float *)calloc((size_t)width, 4) : NULL;
        if (!s || !o || !lsum || (colsum && !cs)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < hkv * blocks; w++) {
            int stop;
            #pragma omp atomic read
            stop = failed;
            if (stop) continue;
            const int64_t h = w / blocks, t0 = (w % blocks) * QB, t1 = t0 + QB < nq ? t0 + QB : nq;
            const int64_t rows = (t1 - t0) * groups; /* row r: token t0 + r / groups, head h * groups + r % groups */
            const uint32_t *kh = kp + h * tiles * 16 * half;
            const float *vh = vf + h * nk * d;
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const uint32_t *qr[4];
                int64_t last = 0;
                for (int j = 0; j < 4; j++) {
                    int64_t r = r0 + j < rows ? r0 + j : rows - 1, t = t0 + r / groups, g = h * groups + r % groups;
                    qr[j] = (const uint32_t *)(q + g * qs_h + t * qs_t);
                    last = pos[t] > last ? pos[t] : last;
                }
                scores4(qr, kh, half, 0, (last + 16) / 16, s + r0 * width, width);
            }
            /* each row's probabilities in place of its scores, zero from its own position + 1 on */
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = pos[t0 + r / groups] + 1, full = n / 16;
                float *sr = s + r * width;
                __m512 sc = _mm512_set1_ps(scale), mx = _mm512_set1_ps(-INFINITY);
                for (int64_t j = 0; j < full; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + 16 * j));
                __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1u);
                if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(sr + 16 * full));
                __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), acc = _mm512_setzero_ps();
                for (int64_t j = 0; j < full; j++) {
                    __m512 e = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * j), sc, m));
                    acc = _mm512_add_ps(acc, e);
                    _mm512_storeu_ps(sr + 16 * j, e);
                }
                int64_t j = full;
                if (tail) {
                    __m512 e = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * j), sc, m)));
                    acc = _mm512_add_ps(acc, e);
                    _mm512_storeu_ps(sr + 16 * j, e);
                    j++;
                }
                for (; j < tiles; j++) _mm512_storeu_ps(sr + 16 * j, _mm512_setzero_ps());
                lsum[r] = _mm512_reduce_add_ps(acc);
                if (cs) {
                    __m512 inv = _mm512_set1_ps(1.0f / lsum[r]);
                    for (int64_t c = 0; c < (n + 15) / 16; c++)
                        _mm512_storeu_ps(cs + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * c), inv,
                                                                      _mm512_loadu_ps(cs + 16 * c)));
                }
            }
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const float *pr[4];
                float *orow[4];
                int64_t last = 0;
                for (int j = 0; j < 4; j++) {
                    int64_t r = r0 + j < rows ? r0 + j : rows - 1;
                    pr[j] = s + r * width;
                    orow[j] = o + (r0 + j) * d; /* rows past `rows` land in the spare rows */
                    last = pos[t0 + r / groups] > last ? pos[t0 + r / groups] : last;
                }
                for (int64_t c = 0; c < d; c += 64) values4(pr, vh, d, c, last + 1, orow);
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / groups, g = h * groups + r % groups;
                __m512 inv = _mm512_set1_ps(1.0f / lsum[r]);
                uint16_t *dst = out + (t * hq + g) * d;
                for (int64_t c = 0; c < d; c += 16) {
                    __m512 y = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv);
                    _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(y));
                }
            }
        }
        if (cs) {
            #pragma omp critical
            for (int64_t j = 0; j < nk; j++) colsum[j] += cs[j];
        }
        free(s);
        free(o);
        free(lsum);
        free(cs);
    }
    free(kp);
    free(vf);
    return failed ? -1 : 0;
}
"""
)

_FLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mfma",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.ragkv_scatter_attention
    fn.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64]
    fn.argtypes += [ctypes.c_float, ctypes.c_int]


# The same algorithm in fp32 for AVX2 and FMA (any x86 CPU of the last decade; fp32 is what `auto`
# picks on one without native bf16): keys packed as [tile][i][8 keys], no rounding but fp32's own.
_SOURCE_FP32 = (
    _PREAMBLE
    + r"""

int ragkv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}


/* e^x for x <= 0 (Cephes' single-precision polynomial, times 2^n built in the exponent bits). */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Scores of four query rows against key tiles [0, t1) of the packed keys (a tile: d floats for each of
   8 keys, [i][key]); s[row][key]. */
static void scores4(const float *const qr[4], const float *kp, int64_t d, int64_t t1, float *s, int64_t ss) {
    int64_t t = 0;
    for (; t + 1 < t1; t += 2) {
        const float *k0 = kp + t * 8 * d, *k1 = k0 + 8 * d;
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i++) {
            __m256 b0 = _mm256_load_ps(k0 + i * 8), b1 = _mm256_load_ps(k1 + i * 8);
            for (int r = 0; r < 4; r++) {
                __m256 q = _mm256_broadcast_ss(qr[r] + i);
                a[2 * r] = _mm256_fmadd_ps(q, b0, a[2 * r]);
                a[2 * r + 1] = _mm256_fmadd_ps(q, b1, a[2 * r + 1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(s + r * ss + t * 8, a[2 * r]);
            _mm256_storeu_ps(s + r * ss + t * 8 + 8, a[2 * r + 1]);
        }
    }
    if (t < t1) {
        const float *k0 = kp + t * 8 * d;
        __m256 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i++) {
            __m256 b0 = _mm256_load_ps(k0 + i * 8);
            for (int r = 0; r < 4; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qr[r] + i), b0, a[r]);
        }
        for (int r = 0; r < 4; r++) _mm256_storeu_ps(s + r * ss + t * 8, a[r]);
    }
}

/* o[row][c..c+16) = P[row] @ V over keys [0, n): the values' rows by stride vs_t. */
static void values4(const float *const pr[4], const float *v, int64_t vs_t, int64_t c, int64_t n,
                    float *const orow[4]) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t key = 0; key < n; key++) {
        __m256 b0 = _mm256_loadu_ps(v + key * vs_t + c), b1 = _mm256_loadu_ps(v + key * vs_t + c + 8);
        for (int r = 0; r < 4; r++) {
            __m256 w = _mm256_broadcast_ss(pr[r] + key);
            a[2 * r] = _mm256_fmadd_ps(w, b0, a[2 * r]);
            a[2 * r + 1] = _mm256_fmadd_ps(w, b1, a[2 * r + 1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(orow[r] + c, a[2 * r]);
        _mm256_storeu_ps(orow[r] + c + 8, a[2 * r + 1]);
    }
}

/* As the bf16 kernel, in fp32 throughout: q: [hq][nq][d] by strides (qs_h, qs_t), k and v:
   [hkv][keys][d] by strides, the last dimension contiguous; out: [nq][hq][d] contiguous; d a
   multiple of 16; colsum (NULL: none) [keys]. Returns 0, -1 when out of memory, -2 when a position
   is not a key slot. */
int ragkv_scatter_attention(const float *q, int64_t qs_h, int64_t qs_t, const float *k, int64_t ks_h,
                            int64_t ks_t, const float *v, int64_t vs_h, int64_t vs_t, const int64_t *pos,
                            int64_t keys, float *out, float *colsum, int64_t hq, int64_t hkv, int64_t nq,
                            int64_t d, float scale, int threads) {
    int64_t maxpos = 0;
    for (int64_t t = 0; t < nq; t++) {
        if (pos[t] < 0 || pos[t] >= keys) return -2;
        maxpos = pos[t] > maxpos ? pos[t] : maxpos;
    }
    const int64_t nk = maxpos + 1, groups = hq / hkv;
    const int64_t tiles = (nk + 15) / 16 * 2, width = tiles * 8;
    float *kp = (float *)alloc64(hkv * width * d * 4);
    if (!kp) return -1;
    /* pack the keys as [head][tile][i][8 keys] (zero past nk) */
    #pragma omp parallel for num_threads(threads) collapse(2) schedule(static) if (threads > 1)
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t t = 0; t < tiles; t++) {
            float *dst = kp + (h * tiles + t) * 8 * d;
            for (int64_t l = 0; l < 8; l++) {
                int64_t key = t * 8 + l;
                const float *src = k + h * ks_h + key * ks_t;
                for (int64_t i = 0; i < d; i++) dst[i * 8 + l] = key < nk ? src[i] : 0.0f;
            }
        }
    const int64_t blocks = (nq + QB - 1) / QB;
    int failed = 0;
    if (colsum) memset(colsum, 0, (size_t)keys * 4);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int64_t rows_max = groups * QB + 3;
        float *s = (float *)alloc64(rows_max * width * 4);
        float *o = (float *)alloc64(rows_max * d * 4);
        float *lsum = (float *)alloc64(rows_max * 4);
        float *cs = colsum ? (float *)calloc((size_t)width, 4) : NULL;
        if (!s || !o || !lsum || (colsum && !cs)) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < hkv * blocks; w++) {
            int stop;
            #pragma omp atomic read
            stop = failed;
            if (stop) continue;
            const int64_t h = w / blocks, t0 = (w % blocks) * QB, t1 = t0 + QB < nq ? t0 + QB : nq;
            const int64_t rows = (t1 - t0) * groups; /* row r: token t0 + r / groups, head h * groups + r % groups */
            const float *kh = kp + h * tiles * 8 * d, *vh = v + h * vs_h;
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const float *qr[4];
                int64_t last = 0;
                for (int j = 0; j < 4; j++) {
                    int64_t r = r0 + j < rows ? r0 + j : rows - 1, t = t0 + r / groups, g = h * groups + r % groups;
                    qr[j] = q + g * qs_h + t * qs_t;
                    last = pos[t] > last ? pos[t] : last;
                }
                scores4(qr, kh, d, (last + 8) / 8, s + r0 * width, width);
            }
            /* each row's probabilities in place of its scores, zero from its own position + 1 on */
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = pos[t0 + r / groups] + 1, vecs = (n + 7) / 8;
                float *sr = s + r * width;
                for (int64_t j = n; j < vecs * 8; j++) sr[j] = -INFINITY;
                __m256 mx = _mm256_set1_ps(-INFINITY), acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < vecs; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + 8 * j));
                const __m256 sc = _mm256_set1_ps(scale), m = _mm256_set1_ps(hmax(mx) * scale);
                for (int64_t j = 0; j < vecs; j++) {
                    __m256 e = exp_ps(_mm256_fmsub_ps(_mm256_loadu_ps(sr + 8 * j), sc, m));
                    _mm256_storeu_ps(sr + 8 * j, e);
                }
                for (int64_t j = n; j < width; j++) sr[j] = 0.0f;
                for (int64_t j = 0; j < vecs; j++) acc = _mm256_add_ps(acc, _mm256_loadu_ps(sr + 8 * j));
                lsum[r] = hsum(acc);
                if (cs) {
                    __m256 inv = _mm256_set1_ps(1.0f / lsum[r]);
                    for (int64_t j = 0; j < vecs; j++)
                        _mm256_storeu_ps(cs + 8 * j, _mm256_fmadd_ps(_mm256_loadu_ps(sr + 8 * j), inv,
                                                                     _mm256_loadu_ps(cs + 8 * j)));
                }
            }
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const float *pr[4];
                float *orow[4];
                int64_t last = 0;
                for (int j = 0; j < 4; j++) {
                    int64_t r = r0 + j < rows ? r0 + j : rows - 1;
                    pr[j] = s + r * width;
                    orow[j] = o + (r0 + j) * d; /* rows past `rows` land in the spare rows */
                    last = pos[t0 + r / groups] > last ? pos[t0 + r / groups] : last;
                }
                for (int64_t c = 0; c < d; c += 16) values4(pr, vh, vs_t, c, last + 1, orow);
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / groups, g = h * groups + r % groups;
                __m256 inv = _mm256_set1_ps(1.0f / lsum[r]);
                float *dst = out + (t * hq + g) * d;
                for (int64_t c = 0; c < d; c += 8)
                    _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c), inv));
            }
        }
        if (cs) {
            #pragma omp critical
            for (int64_t j = 0; j < nk; j++) colsum[j] += cs[j];
        }
        free(s);
        free(o);
        free(lsum);
        free(cs);
    }
    free(kp);
    return failed ? -1 : 0;
}
"""
)

_FLAGS_FP32 = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

ATTENTION = NativeLibrary(
    "scatter_attention",
    _SOURCE,
    _FLAGS,
    what="native bf16 attention kernel",
    fallback="fusion's attention runs in torch's SDPA",
    isa=("AVX512",),
    declare=_declare,
)
ATTENTION_FP32 = NativeLibrary(
    "scatter_attention_fp32",
    _SOURCE_FP32,
    _FLAGS_FP32,
    what="native fp32 attention kernel",
    fallback="fusion's attention runs in torch's SDPA",
    isa=("AVX2", "AVX512"),
    declare=_declare,
)
_LIBRARIES = {torch.bfloat16: ATTENTION, torch.float32: ATTENTION_FP32}
_HEAD_MULTIPLE = {torch.bfloat16: 64, torch.float32: 16}  # head sizes each kernel takes: multiples of these

_REFUSED = ("sliding_window", "s_aux")  # keyword arguments the kernel does not compute (besides soft-capping, dropout)


def attention_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`scatter_attention` runs here for ``dtype``: bf16 needs AVX-512 and AVX512-BF16,
    fp32 AVX2 and FMA (and either a C compiler, the kernel built)."""
    library = _LIBRARIES.get(dtype)
    return library is not None and library.get() is not None


def scatter_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a kernel computes this attention call exactly as the model asks it.

    ``query`` ``[1, Hq, q, D]``, ``key``/``value`` ``[1, Hkv, keys, D]``, all bf16 (``D`` a multiple
    of 64) or all fp32 (``D`` a multiple of 16), on the CPU with a contiguous last dimension, ``Hq``
    a multiple of ``Hkv``; ``kwargs`` the call's keyword arguments (no dropout, soft-capping,
    sliding window or attention sinks).
    """
    if any(kwargs.get(name) is not None for name in _REFUSED) or kwargs.get("dropout") or kwargs.get("softcap"):
        return False
    tensors, dtype = (query, key, value), query.dtype
    if dtype not in _LIBRARIES:
        return False
    if any(t.device.type != "cpu" or t.dtype != dtype or t.dim() != 4 or t.stride(3) != 1 for t in tensors):
        return False
    (b, hq, _, d), (kb, hkv, _, kd) = query.shape, key.shape
    if b != 1 or kb != 1 or d % _HEAD_MULTIPLE[dtype] or kd != d or hkv == 0 or hq % hkv or value.shape != key.shape:
        return False
    return attention_available(dtype)


def scatter_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    scaling: float | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries at slots ``query_pos`` over the slots up to each one's own, by the kernel.

    ``query`` ``[1, Hq, q, D]``, ``key``/``value`` ``[1, Hkv, slots, D]`` (see :func:`scatter_applies`),
    ``query_pos`` ``[q]`` integer slots on the host. Returns ``[1, q, Hq, D]`` in the query's dtype, as
    transformers' attention functions return it. ``weights``, when given (fp32 ``[slots]``,
    contiguous), is set to each slot's attention probability summed over heads and queries (what
    fusion's question probe records). Raises ValueError for a position outside the slots or a
    wrong ``weights``, RuntimeError where the kernel is not available or memory runs out.
    """
    library = _LIBRARIES.get(query.dtype)
    lib = None if library is None else library.get()
    if lib is None:
        raise RuntimeError(f"the native attention kernel for {query.dtype} is not available here (see the log for why)")
    _, hq, nq, d = query.shape
    hkv, slots = key.shape[1], key.shape[2]
    if query_pos.shape != (nq,):
        raise ValueError(f"query_pos must be [{nq}] (one slot per query), got {tuple(query_pos.shape)}")
    if weights is not None and (
        weights.shape != (slots,) or weights.dtype != torch.float32 or not weights.is_contiguous()
    ):
        raise ValueError(
            f"weights must be a contiguous float32 [{slots}] tensor, got {weights.dtype} {tuple(weights.shape)}"
        )
    out = torch.empty(1, nq, hq, d, dtype=query.dtype)
    if nq == 0:
        if weights is not None:
            weights.zero_()
        return out
    pos = query_pos.to(device="cpu", dtype=torch.int64).contiguous()
    scale = float(scaling) if scaling is not None else d**-0.5
    args = (
        *(query.data_ptr(), query.stride(1), query.stride(2)),
        *(key.data_ptr(), key.stride(1), key.stride(2)),
        *(value.data_ptr(), value.stride(1), value.stride(2)),
        *(pos.data_ptr(), slots, out.data_ptr(), None if weights is None else weights.data_ptr()),
        *(hq, hkv, nq, d, scale, torch.get_num_threads()),
    )
    rc = profiled_call(PROFILED_NAME, lib.ragkv_scatter_attention, *args)
    if rc == -2:
        raise ValueError(f"query positions must lie in [0, {slots}) (the key slots)")
    if rc != 0:
        raise RuntimeError("the native attention kernel ran out of memory")
    return out
