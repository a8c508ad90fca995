"""Small-batch matrix multiply on the CPU: a C mat-vec up to eight rows, oneDNN with
pre-packed weights up to 64.

Decode steps multiply a handful of rows by every weight matrix. For those, oneDNN with the
weight reordered once into its blocked layout is 1.3-2.5x faster than the default GEMM; for
large prefill batches the default GEMM is as fast or faster. So layers keep their plain weight
and may add a packed copy, and `linear` picks per call. At a few rows the multiply only
streams the weight once, and a loop of dot products four weight rows at a time
(`GEMV_SOURCE`, built by `c_library`) keeps up with that stream where oneDNN does not: on the
benchmark checkpoint's 80 MB of weights, 2.0 against 3.4 ms at one row, 4.7 against 5.1 at
eight (figures at `GEMV_ROWS`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridserve.kernels import c_library
from hybridserve.kernels.dispatch import BACKEND_ENV

# Rows at or below which the packed weight is used (measured crossover is between 64 and 300).
SMALL_BATCH = 64
# The batch size oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32
# Rows at or below which the C mat-vec is used. Every weight of the benchmark checkpoint once,
# same process: 2.0 / 2.4 / 3.1 / 4.7 / 8.1 ms at 1 / 2 / 4 / 8 / 16 rows against oneDNN's
# packed GEMM's 3.4 / 3.5 / 3.7 / 5.1 / 6.7 ms; they cross between 8 and 16.
GEMV_ROWS = 8

# The dot products of the mat-vecs. `dot`: one weight row with one input row. With one
# accumulator register each FMA waits for the one before (a chain of cols / 16 of them per row),
# and at one decode row that chain, not memory, bounds a core's stream of weights; 64 partial
# sums (4 AVX-512 or 8 AVX2 registers) let the loads run ahead.
#
# `dot_rows`: up to four consecutive weight rows with one input row, the mat-vecs' inner step.
# Row by row, every row ends in a reduction of its partial sums across the register, and
# the next row's loads wait behind it; on this checkpoint's short rows (512 or 1536 floats)
# that reduction is a large share of the work. Four rows at a time keep four streams of loads
# going, share each load of the input, and end in one reduction per row after them. A
# standalone C probe on the benchmark VM (two threads, the checkpoint's matrix shapes, 92 MB,
# one row): 4.2-4.4 ms row by row, 2.0-2.5 ms four at a time, 1.3-1.4 ms to only read the same
# bytes. Further input rows reuse the four weight rows from L1 or L2 (4 x 6 KB at most here).
DOT_SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[64] = {0.0f};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
#pragma omp simd
        for (int64_t k = 0; k < 64; ++k) lanes[k] += a[i + k] * b[i + k];
    }
    float acc = 0.0f;
    for (; i < n; ++i) acc += a[i] * b[i];
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < 64; ++k) acc += lanes[k];
    return acc;
}

/* A register of floats: 16 with AVX-512, else 8 (AVX2; two NEON registers). Two per weight
   row, eight in all, fit the 16 registers of AVX2 with the input's two beside them. */
#if defined(__AVX512F__)
#define DOT_LANES 16
#else
#define DOT_LANES 8
#endif
typedef float dot_vec __attribute__((vector_size(DOT_LANES * sizeof(float))));
#define DOT_AHEAD 512 /* floats: how far ahead of its loads a weight row is prefetched */

static inline dot_vec dot_load(const float *p) {
    dot_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of a register's lanes, halving it until one is left: log2(DOT_LANES) dependent adds,
   where a lane at a time chains DOT_LANES - 1 of them (floats' adds are not reordered for us). */
static inline float dot_sum(dot_vec v) {
    float lanes[DOT_LANES];
    memcpy(lanes, &v, sizeof v);
    for (int width = DOT_LANES / 2; width > 0; width /= 2)
        for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
    return lanes[0];
}

/* y[j] = W[j] . x for the `count` rows of W from w (rows n apart), count <= 4. */
static inline void dot_rows(const float *w, int64_t count, int64_t n, const float *x, float *y) {
    if (count < 4) {
        for (int64_t j = 0; j < count; ++j) y[j] = dot(w + j * n, x, n);
        return;
    }
    const float *w0 = w, *w1 = w + n, *w2 = w + 2 * n, *w3 = w + 3 * n;
    dot_vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 2 * DOT_LANES <= n; i += 2 * DOT_LANES) {
        /* Each row's lines 2 KiB ahead, into every cache level (a hint: past the matrix's end
           it touches nothing). The hardware's prefetcher alone ran the four streams 6-7%
           slower (every weight of the checkpoint once, interleaved: 2.15 against 2.02 ms). */
        for (int64_t k = 0; k < 2 * DOT_LANES; k += 16) {
            __builtin_prefetch(w0 + i + DOT_AHEAD + k, 0, 3);
            __builtin_prefetch(w1 + i + DOT_AHEAD + k, 0, 3);
            __builtin_prefetch(w2 + i + DOT_AHEAD + k, 0, 3);
            __builtin_prefetch(w3 + i + DOT_AHEAD + k, 0, 3);
        }
        const dot_vec xa = dot_load(x + i), xb = dot_load(x + i + DOT_LANES);
        a0 += dot_load(w0 + i) * xa;
        b0 += dot_load(w0 + i + DOT_LANES) * xb;
        a1 += dot_load(w1 + i) * xa;
        b1 += dot_load(w1 + i + DOT_LANES) * xb;
        a2 += dot_load(w2 + i) * xa;
        b2 += dot_load(w2 + i + DOT_LANES) * xb;
        a3 += dot_load(w3 + i) * xa;
        b3 += dot_load(w3 + i + DOT_LANES) * xb;
    }
    y[0] = dot_sum(a0 + b0);
    y[1] = dot_sum(a1 + b1);
    y[2] = dot_sum(a2 + b2);
    y[3] = dot_sum(a3 + b3);
    for (; i < n; ++i) {
        y[0] += w0[i] * x[i];
        y[1] += w1[i] * x[i];
        y[2] += w2[i] * x[i];
        y[3] += w3[i] * x[i];
    }
}
"""

GEMV_SOURCE = (
    DOT_SOURCE
    + r"""
/* y (rows, out) = x (rows, in) W^T (W: out x in, row-major) + bias (may be NULL), by the
   team of the enclosing parallel region. Each thread streams its share of W's rows once, four
   at a time; x's rows stay in L1. Shares are handed out in shrinking pieces (guided), not
   fixed halves: on a VM one thread often runs slower, and with fixed halves the other waits
   for it (10% of the one-row decode step's GEMV time). */
static void gemv_team(const float *W, int64_t out, int64_t in, const float *x, int64_t rows,
                      const float *bias, float *y) {
#pragma omp for schedule(guided, 8)
    for (int64_t o = 0; o < out; o += 4) {
        const int64_t count = out - o < 4 ? out - o : 4;
        for (int64_t r = 0; r < rows; ++r) {
            float *yr = y + r * out + o;
            dot_rows(W + o * in, count, in, x + r * in, yr);
            if (bias)
                for (int64_t j = 0; j < count; ++j) yr[j] += bias[o + j];
        }
    }
}

void gemv_f32(const float *W, int64_t out, int64_t in, const float *x, int64_t rows,
              const float *bias, float *y) {
#pragma omp parallel
    gemv_team(W, out, in, x, rows, bias, y);
}

/* `count` mat-vecs y_i = x_i W_i^T, one after another in one parallel region, as the native
   decode step runs its mat-vecs: what the weights alone cost a step, with no call or team
   wake-up between them (bench/common.gemm_floor_ms). */
void gemv_each_f32(int64_t count, const float *const *W, const int64_t *out, const int64_t *in,
                   const float *const *x, int64_t rows, float *const *y) {
#pragma omp parallel
    for (int64_t i = 0; i < count; ++i) gemv_team(W[i], out[i], in[i], x[i], rows, NULL, y[i]);
}
"""
)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) -> an opaque oneDNN-packed copy for `linear(..., packed=...)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x weight^T + bias; x: (M, in), weight: (out, in)."""
    if x.dim() == 2 and x.shape[0] <= GEMV_ROWS and _gemv_applies(x, weight, bias):
        return _gemv(x, weight, bias)
    if packed is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        not torch.compiler.is_compiling()  # traced GEMMs go through `packed_linear`
        and weight.device.type == "cpu"
        and weight.dtype == x.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_grad_enabled()
        and gemv_kernel() is not None
    )


@functools.cache
def gemv_kernel() -> ctypes._CFuncPtr | None:
    # HYBRIDSERVE_KERNEL_BACKEND=reference means torch everywhere (read once per process).
    if os.environ.get(BACKEND_ENV) == "reference":
        return None
    argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return c_library.function("gemv", GEMV_SOURCE, "gemv_f32", argtypes)


@functools.cache
def gemv_each_kernel() -> ctypes._CFuncPtr | None:
    """`gemv_each_f32(count, W, out, in, x, rows, y)` (arrays of `count` pointers and sizes),
    or None where the mat-vec does not build."""
    if gemv_kernel() is None:
        return None
    argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return c_library.function("gemv", GEMV_SOURCE, "gemv_each_f32", argtypes)


def gemv_each(
    weights: list[torch.Tensor], inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> Callable[[], None] | None:
    """A call that runs outputs[i] = inputs[i] weights[i]^T for every i in one parallel region
    (contiguous fp32 CPU tensors, inputs of equally many rows), its arguments built once; None
    where the mat-vec does not build."""
    kernel = gemv_each_kernel()
    if kernel is None:
        return None

    def addresses(tensors: list[torch.Tensor]) -> ctypes.Array:
        return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))

    def sizes(values: list[int]) -> ctypes.Array:
        return (ctypes.c_int64 * len(values))(*values)

    arguments = (
        len(weights),
        addresses(weights),
        sizes([w.shape[0] for w in weights]),
        sizes([w.shape[1] for w in weights]),
        addresses(inputs),
        inputs[0].shape[0],
        addresses(outputs),
    )
    return lambda: kernel(*arguments)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = gemv_kernel()
    assert kernel is not None
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    rows, (out, inner) = x.shape[0], weight.shape
    y = torch.empty((rows, out), dtype=torch.float32)
    kernel(
        weight.data_ptr(),
        out,
        inner,
        x.data_ptr(),
        rows,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
    )
    return y
