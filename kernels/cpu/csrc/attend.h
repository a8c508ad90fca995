#pragma once

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
   Shared with the one-row decode step (decode_step.c). */
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
