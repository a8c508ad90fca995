#include "dot.h"
#include "fp8.h"

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

/* gemv_f32 with an FP8 W (fp8.h): y = x W^T + bias, W e4m3 bytes (out x in) with `scale`
   (out x groups) per `group` columns, rows <= 8. */
void gemv_fp8(const uint8_t *W, const float *scale, int64_t out, int64_t in, int64_t group,
              const float *x, int64_t rows, const float *bias, float *y) {
    const int64_t groups = (in + group - 1) / group;
#pragma omp parallel for schedule(guided, 8)
    for (int64_t o = 0; o < out; ++o) {
        dot_fp8_rows(W + o * in, scale + o * groups, in, group, x, in, rows, y + o, out);
        if (bias)
            for (int64_t r = 0; r < rows; ++r) y[r * out + o] += bias[o];
    }
}
