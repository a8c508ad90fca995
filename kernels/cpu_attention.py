"""Paged attention of decode rows on the CPU, reading each key and value once: a small C kernel.

The torch reference gathers every row's blocks into one contiguous tensor, copies it again to
put heads first, and only then runs attention over it: three passes over the context's keys
and values. At 32 rows of ~700 tokens on the benchmark checkpoint that is ~70 MB of traffic
and ~3 ms of a 17 ms step. This kernel walks each row's block table and keeps a running
softmax (one pass, nothing gathered):

    for each token t < seq_len:   s = scale * q . k_t;   m' = max(m, s)
        l = l * exp(m - m') + exp(s - m');   acc = acc * exp(m - m') + exp(s - m') * v_t

per row and query head; the query heads that share a KV head are done together, so each key
and value is read once for all of them. `acc / l` is the output. Rows with seq_len 0 output
zeros (the decode graphs' padding rows).

Built like the state-update kernel (`c_library`, ctypes); registered as
`hybridserve::attention_decode`, which the compiled decode step calls as is, and serving
`paged_attention_decode` for the eager CPU path (`dispatch.CPU_KERNELS`). fp32 caches only;
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

/* q, out: (rows, H, D). key, value: block b's (Hkv, block_size, D) starts b * block_stride
   floats in. tables: (rows, width) block ids; seq_lens: (rows,) tokens to attend to. */
void attention_decode_f32(const float *q, const float *key, const float *value,
                          int64_t block_stride, const int64_t *tables, int64_t width,
                          const int64_t *seq_lens, int64_t rows, int64_t H, int64_t Hkv,
                          int64_t D, int64_t block_size, float scale, float *out) {
    const int64_t group = H / Hkv;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t first_head = g * group, len = seq_lens[r];
            float *o = out + (r * H + first_head) * D;
            if (len <= 0) {
                memset(o, 0, sizeof(float) * group * D);
                continue;
            }
            const float *qg = q + (r * H + first_head) * D;
            float m[group], l[group];
            for (int64_t h = 0; h < group; ++h) {
                m[h] = -INFINITY;
                l[h] = 0.0f;
            }
            memset(o, 0, sizeof(float) * group * D);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t block = tables[r * width + t / block_size];
                const int64_t at = block * block_stride + (g * block_size + t % block_size) * D;
                const float *k = key + at, *v = value + at;
                for (int64_t h = 0; h < group; ++h) {
                    const float *qh = qg + h * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
                    s *= scale;
                    float *oh = o + h * D;
                    if (s > m[h]) {
                        const float shrink = expf(m[h] - s);
                        l[h] = l[h] * shrink + 1.0f;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) oh[d] = oh[d] * shrink + v[d];
                        m[h] = s;
                    } else {
                        const float p = expf(s - m[h]);
                        l[h] += p;
#pragma omp simd
                        for (int64_t d = 0; d < D; ++d) oh[d] += p * v[d];
                    }
                }
            }
            for (int64_t h = 0; h < group; ++h) {
                const float inverse = 1.0f / l[h];
                for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inverse;
            }
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
    return _kernel() is not None


def _kernel() -> ctypes._CFuncPtr | None:
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
    kernel = _kernel()
    assert kernel is not None, "the kernel before build(): check available() first"
    rows, H, D = q.shape
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    q = q.contiguous().float()
    tables, lens = block_tables.contiguous().long(), seq_lens.contiguous().long()
    out = torch.empty((rows, H, D), dtype=torch.float32)
    kernel(
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


_LIBRARY = torch.library.Library("hybridserve", "FRAGMENT")
_LIBRARY.define(
    "attention_decode(Tensor q, Tensor kv_pool, int layer, Tensor block_tables, "
    "Tensor seq_lens, float scale) -> Tensor"
)


def _attention_decode(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return _attend(q, kv_pool[:, layer, 0], kv_pool[:, layer, 1], block_tables, seq_lens, scale)


_LIBRARY.impl("attention_decode", _attention_decode, "CPU")


@torch.library.register_fake("hybridserve::attention_decode")
def _attention_decode_shape(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


attention_decode = torch.ops.hybridserve.attention_decode.default
