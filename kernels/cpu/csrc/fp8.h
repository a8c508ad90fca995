#pragma once

#include "dot.h"

/* FP8 weights: float8_e4m3fn bytes, each row with a float32 scale per `group` columns. A
   byte's sign, exponent and mantissa shifted into float16's places are the same number times
   2^-8 (normals and subnormals alike: the biases differ by 8), so a register of bytes becomes
   floats through the hardware's float16 conversion; the 2^8 is applied once per row. The
   weight stream is a quarter of float32's: at one row (memory-bound) the mat-vec is ~3x the
   float32 one, at eight ~1.6x (bench/fp8_weights.py, docs/benchmarks.md). */
static inline float fp8_value(uint8_t b) {
    const uint16_t bits = (uint16_t)(((b & 0x7f) << 7) | ((b & 0x80) << 8));
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

#define FP8_UNSCALE 256.0f

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* DOT_LANES bytes from p as floats, times 2^-8. */
static inline dot_vec fp8_load(const uint8_t *p) {
    dot_vec v;
#if defined(__AVX512F__)
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m512 f = _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
    memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__) && defined(__F16C__)
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m256 f = _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
    memcpy(&v, &f, sizeof v);
#else
    float lanes[DOT_LANES];
    for (int k = 0; k < DOT_LANES; ++k) lanes[k] = fp8_value(p[k]);
    memcpy(&v, lanes, sizeof v);
#endif
    return v;
}

/* Row w of W times R input rows (x + r * x_stride) into y[r * y_stride]: each register of
   bytes is decoded once and multiplied into every row's sums. R is a constant in each
   instance (FP8_DOT_ROWS), so the R sums stay in registers. */
#define FP8_DOT_ROWS(R)                                                                        \
    static inline void dot_fp8_rows_##R(const uint8_t *w, const float *s, int64_t n,          \
                                        int64_t group, const float *x, int64_t x_stride,       \
                                        float *y, int64_t y_stride) {                          \
        dot_vec acc[R] = {0};                                                                  \
        float tail[R] = {0};                                                                   \
        for (int64_t start = 0, g = 0; start < n; start += group, ++g) {                      \
            const int64_t end = start + group < n ? start + group : n;                        \
            dot_vec part[R] = {0};                                                             \
            int64_t i = start;                                                                 \
            for (; i + DOT_LANES <= end; i += DOT_LANES) {                                     \
                const dot_vec v = fp8_load(w + i);                                             \
                for (int r = 0; r < R; ++r) part[r] += v * dot_load(x + r * x_stride + i);    \
            }                                                                                  \
            for (int r = 0; r < R; ++r) acc[r] += part[r] * s[g];                             \
            for (; i < end; ++i) {                                                             \
                const float wi = fp8_value(w[i]) * s[g];                                       \
                for (int r = 0; r < R; ++r) tail[r] += wi * x[r * x_stride + i];               \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; ++r)                                                            \
            y[r * y_stride] = (dot_sum(acc[r]) + tail[r]) * FP8_UNSCALE;                       \
    }
FP8_DOT_ROWS(1)
FP8_DOT_ROWS(2)
FP8_DOT_ROWS(3)
FP8_DOT_ROWS(4)
FP8_DOT_ROWS(5)
FP8_DOT_ROWS(6)
FP8_DOT_ROWS(7)
FP8_DOT_ROWS(8)
#undef FP8_DOT_ROWS

/* FP8_DOT_ROWS for 1 to 8 input rows (the mat-vecs' and the native step's most). */
static inline void dot_fp8_rows(const uint8_t *w, const float *s, int64_t n, int64_t group,
                                const float *x, int64_t x_stride, int64_t rows, float *y,
                                int64_t y_stride) {
    switch (rows) {
        case 1: dot_fp8_rows_1(w, s, n, group, x, x_stride, y, y_stride); break;
        case 2: dot_fp8_rows_2(w, s, n, group, x, x_stride, y, y_stride); break;
        case 3: dot_fp8_rows_3(w, s, n, group, x, x_stride, y, y_stride); break;
        case 4: dot_fp8_rows_4(w, s, n, group, x, x_stride, y, y_stride); break;
        case 5: dot_fp8_rows_5(w, s, n, group, x, x_stride, y, y_stride); break;
        case 6: dot_fp8_rows_6(w, s, n, group, x, x_stride, y, y_stride); break;
        case 7: dot_fp8_rows_7(w, s, n, group, x, x_stride, y, y_stride); break;
        default: dot_fp8_rows_8(w, s, n, group, x, x_stride, y, y_stride); break;
    }
}
