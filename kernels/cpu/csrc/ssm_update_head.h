#pragma once

#include <math.h>
#include <stdint.h>

/* One head of one row: its state (P, N) advanced in place and its output (P). dt prepared;
   b, c: the head's group of B and C (N); skip: D of the head (0 without D). Shared with the
   one-row decode step (decode_step.c). */
static inline void ssm_update_head(float *state, int64_t P, int64_t N, const float *xs,
                                   float step, float A, const float *b, const float *c,
                                   float skip, float *out) {
    const float decay = expf(step * A);
    for (int64_t p = 0; p < P; ++p) {
        float *s = state + p * N;
        const float input = step * xs[p];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
            const float v = s[n] * decay + input * b[n];
            s[n] = v;
            acc += v * c[n];
        }
        out[p] = acc + skip * xs[p];
    }
}
