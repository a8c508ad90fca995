"""Paged attention of decode rows on the CPU, reading each key and value once: a small C kernel.

The torch reference gathers every row's blocks into one contiguous tensor, copies it again to
put heads first, and only then runs attention over it: three passes over the context's keys
and values. At 32 rows of ~700 tokens on the benchmark checkpoint that is ~70 MB of traffic
and ~3 ms of a 17 ms step. This kernel walks each row's block table and keeps a running
softmax, block by block (one pass, nothing gathered):

    for each block:   s_t = scale * q . k_t  (its tokens t);   m' = max(m, max_t s_t)
        l   = l   * exp(m - m') + sum_t exp(s_t - m')
        acc = acc * exp(m - m') + sum_t exp(s_t - m') * v_t

per row and query head; the query heads that share a KV head are done together, so each key
and value is read once for all of them. `acc / l` is the output. Rows with seq_len 0 output
zeros (the decode graphs' padding rows).

Built like the state-update kernel (`c_library`, ctypes); serving `paged_attention_decode`
for the eager CPU path (`dispatch.CPU_KERNELS`) and, as the operator
`hybridserve::attention_decode` (kernels/cpu_ops.py), the compiled decode step. fp32 caches only;
anything else, or no compiler, runs the reference. Tests: tests/kernels/test_cpu_attention.py.
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels import c_library
from hybridserve.kernels.reference import paged_attention_decode_ref

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 to ~2 ulp (Cephes' expf polynomial after x = n ln2 + r), written so the
   compiler vectorises a loop of it (libm's expf is a call per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t bits; float value; } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

enum { MAX_GROUP = 16 };

/* scores[h * stride + t] = scale * q_h . k_t for the group's heads and the block's n tokens.
   With D a multiple of 16 and at most MAX_GROUP heads, each key is loaded once, in 16-float
   pieces, for all heads of the group. */
#define INLINE static inline __attribute__((always_inline))

INLINE void block_scores(const float *qg, const float *k, int64_t n, int64_t group, int64_t D,
                         float scale, float *scores, int64_t stride) {
    if (D % 16 == 0 && group <= MAX_GROUP) {
        for (int64_t t = 0; t < n; ++t) {
            const float *kt = k + t * D;
            v16 acc[MAX_GROUP];
            for (int64_t h = 0; h < group; ++h) acc[h] = (v16){0};
            for (int64_t d = 0; d < D; d += 16) {
                const v16 piece = load16(kt + d);
                for (int64_t h = 0; h < group; ++h) acc[h] += load16(qg + h * D + d) * piece;
            }
            for (int64_t h = 0; h < group; ++h) scores[h * stride + t] = sum16(acc[h]) * scale;
        }
        return;
    }
    for (int64_t h = 0; h < group; ++h)
        for (int64_t t = 0; t < n; ++t) {
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot += qg[h * D + d] * k[t * D + d];
            scores[h * stride + t] = dot * scale;
        }
}

enum { MAX_PIECES = 16 };

/* out = out * shrink + sum_t p[t] * v_t over the block's n tokens. With D a multiple of 16
   (at most 16 * MAX_PIECES) the output row stays in registers for the whole block. */
INLINE void accumulate_values(float *out, float shrink, const float *p, const float *v,
                              int64_t n, int64_t D) {
    if (D % 16 == 0 && D <= 16 * MAX_PIECES) {
        v16 acc[MAX_PIECES];
        const int64_t pieces = D / 16;
        for (int64_t j = 0; j < pieces; ++j) acc[j] = load16(out + 16 * j) * shrink;
        for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < pieces; ++j) acc[j] += p[t] * load16(v + t * D + 16 * j);
        memcpy(out, acc, sizeof(float) * D);
        return;
    }
    for (int64_t d = 0; d < D; ++d) out[d] *= shrink;
    for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < D; ++d) out[d] += p[t] * v[t * D + d];
}

/* One row's query heads of KV head g (the `group` heads sharing it) over its len tokens. */
INLINE void attend(
        const float *qg, const float *key, const float *value, int64_t block_stride,
        const int64_t *table, int64_t len, int64_t g, int64_t group, int64_t D,
        int64_t block_size, float scale, float *o) {
    memset(o, 0, sizeof(float) * group * D);
    if (len <= 0) return;
    float m[group], l[group], s[group * block_size];
    for (int64_t h = 0; h < group; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        const int64_t at = table[t0 / block_size] * block_stride + g * block_size * D;
        const float *k = key + at, *v = value + at;
        block_scores(qg, k, n, group, D, scale, s, block_size);
        for (int64_t h = 0; h < group; ++h) {
            float *sh = s + h * block_size, best = m[h];
            for (int64_t t = 0; t < n; ++t) best = sh[t] > best ? sh[t] : best;
            /* ~0 on the first block, where l and the sums are 0 */
            const float shrink = exp_nonpositive(m[h] - best);
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < n; ++t) {
                sh[t] = exp_nonpositive(sh[t] - best);
                total += sh[t];
            }
            l[h] = l[h] * shrink + total;
            m[h] = best;
            accumulate_values(o + h * D, shrink, sh, v, n, D);
        }
    }
    for (int64_t h = 0; h < group; ++h) {
        const float inverse = 1.0f / l[h];
        for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inverse;
    }
}

/* `attend` inlined with D a constant for the common head sizes, so the loops over D unroll.
   Shared with the one-row decode step (kernels/cpu_decode_step.py). */
static inline void attend_group(
        const float *qg, const float *key, const float *value, int64_t block_stride,
        const int64_t *table, int64_t len, int64_t g, int64_t group, int64_t D,
        int64_t block_size, float scale, float *o) {
    if (D == 64)
        attend(qg, key, value, block_stride, table, len, g, group, 64, block_size, scale, o);
    else if (D == 128)
        attend(qg, key, value, block_stride, table, len, g, group, 128, block_size, scale, o);
    else
        attend(qg, key, value, block_stride, table, len, g, group, D, block_size, scale, o);
}

/* q, out: (rows, H, D). key, value: block b's (Hkv, block_size, D) starts b * block_stride
   floats in. tables: (rows, width) block ids; seq_lens: (rows,) tokens to attend to.
   Block by block: the scores of the block's tokens for every query head of the group, then
   one rescale of the running sums per head and block, not per token. */
void attention_decode_f32(const float *q, const float *key, const float *value,
                          int64_t block_stride, const int64_t *tables, int64_t width,
                          const int64_t *seq_lens, int64_t rows, int64_t H, int64_t Hkv,
                          int64_t D, int64_t block_size, float scale, float *out) {
    const int64_t group = H / Hkv;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t offset = (r * H + g * group) * D;
            attend_group(q + offset, key, value, block_stride, tables + r * width, seq_lens[r],
                         g, group, D, block_size, scale, out + offset);
        }
    }
}
"""
_ARGTYPES = (
    [ctypes.c_void_p] * 3
    + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    + [ctypes.c_int64] * 5
    + [ctypes.c_float, ctypes.c_void_p]
)


def build() -> bool:
    """Compile (or find in the cache) and load the kernel, once per process; whether it is
    usable."""
    return kernel() is not None


def kernel() -> ctypes._CFuncPtr | None:
    return c_library.function("attention_decode", SOURCE, "attention_decode_f32", _ARGTYPES)


def available(cache: torch.Tensor) -> bool:
    """Whether the kernel can read this cache: the KV pool (num_blocks, layers, 2, Hkv,
    block_size, D) or one layer's key or value view (num_blocks, Hkv, block_size, D), fp32 on
    the CPU, each block's (Hkv, block_size, D) contiguous, and the kernel built (`build`)."""
    block = cache[0, 0, 0] if cache.dim() == 6 else cache[0]
    return (
        c_library.loaded("attention_decode", "attention_decode_f32")
        and cache.device.type == "cpu"
        and cache.dtype == torch.float32
        and block.is_contiguous()
    )


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_decode_ref` (same arguments) through the kernel where it applies."""
    usable = (
        build()
        and available(key_cache)
        and available(value_cache)
        and key_cache.stride(0) == value_cache.stride(0)
    )
    if not usable:
        return paged_attention_decode_ref(
            q, key_cache, value_cache, block_tables=block_tables, seq_lens=seq_lens, scale=scale
        )
    return _attend(q, key_cache, value_cache, block_tables, seq_lens, scale).to(q.dtype)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel on (num_blocks, Hkv, block_size, D) key and value views; fp32 output."""
    run = kernel()
    assert run is not None, "the kernel before build(): check available() first"
    rows, H, D = q.shape
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    q = q.contiguous().float()
    tables, lens = block_tables.contiguous().long(), seq_lens.contiguous().long()
    out = torch.empty((rows, H, D), dtype=torch.float32)
    run(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        rows,
        H,
        Hkv,
        D,
        block_size,
        scale,
        out.data_ptr(),
    )
    return out
