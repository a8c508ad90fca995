#pragma once
/*
 * The dot products of the mat-vecs. `dot`: one weight row with one input row. With one
 * accumulator register each FMA waits for the one before (a chain of cols / 16 of them per row),
 * and at one decode row that chain, not memory, bounds a core's stream of weights; 64 partial
 * sums (4 AVX-512 or 8 AVX2 registers) let the loads run ahead.
 *
 * `dot_rows`: up to four consecutive weight rows with one input row, the mat-vecs' inner step.
 * Row by row, every row ends in a reduction of its partial sums across the register, and
 * the next row's loads wait behind it; on this checkpoint's short rows (512 or 1536 floats)
 * that reduction is a large share of the work. Four rows at a time keep four streams of loads
 * going, share each load of the input, and end in one reduction per row after them. A
 * standalone C probe on the benchmark VM (two threads, the checkpoint's matrix shapes, 92 MB,
 * one row): 4.2-4.4 ms row by row, 2.0-2.5 ms four at a time, 1.3-1.4 ms to only read the same
 * bytes. Further input rows reuse the four weight rows from L1 or L2 (4 x 6 KB at most here).
 */

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
