"""Small-batch matrix multiply on the CPU: a C mat-vec for one or two rows, oneDNN with
pre-packed weights up to 64.

Decode steps multiply a handful of rows by every weight matrix. For those, oneDNN with the
weight reordered once into its blocked layout is 1.3-2.5x faster than the default GEMM; for
large prefill batches the default GEMM is as fast or faster. So layers keep their plain weight
and may add a packed copy, and `linear` picks per call. At one or two rows the multiply only
streams the weight once, and a plain loop of dot products (`GEMV_SOURCE`, built by
`c_library`) does that at the memory's speed where oneDNN does not: on the benchmark
checkpoint's 80 MB of weights, 2.5 against 4.0 ms at one row, 3.1 against 4.3 at two, slower
from four rows on.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from hybridserve.kernels import c_library
from hybridserve.kernels.dispatch import BACKEND_ENV

# Rows at or below which the packed weight is used (measured crossover is between 64 and 300).
SMALL_BATCH = 64
# The batch size oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32
# Rows at or below which the C mat-vec is used.
GEMV_ROWS = 2

# A dot product of a weight row with one input row, as every mat-vec here takes it. With one
# accumulator register each FMA waits for the one before (a chain of cols / 16 of them per row),
# and at one decode row that chain, not memory, bounds a core's stream of weights; 64 partial
# sums (4 AVX-512 or 8 AVX2 registers) let the loads run ahead. The one-row decode step went
# from 3.2-3.5 to 2.8-2.9 ms per token on the benchmark VM (kernels/cpu_decode_step.py).
DOT_SOURCE = r"""
#include <stdint.h>

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
"""

GEMV_SOURCE = (
    DOT_SOURCE
    + r"""
/* y (rows, out) = x (rows, in) W^T (W: out x in, row-major) + bias (may be NULL). Each
   thread streams its share of W's rows once; x's rows stay in L1. Shares are handed out in
   shrinking pieces (guided), not fixed halves: on a VM one thread often runs slower, and
   with fixed halves the other waits for it (10% of the one-row decode step's GEMV time). */
void gemv_f32(const float *W, int64_t out, int64_t in, const float *x, int64_t rows,
              const float *bias, float *y) {
#pragma omp parallel for schedule(guided, 32)
    for (int64_t o = 0; o < out; ++o) {
        const float *w = W + o * in;
        for (int64_t r = 0; r < rows; ++r)
            y[r * out + o] = dot(w, x + r * in, in) + (bias ? bias[o] : 0.0f);
    }
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
