#include "ssm_update_head.h"

/* pool: the layer's state of slot 0; slot s starts slot_stride floats further.
   x: (rows, H, P); dt: (rows, H), prepared (bias, softplus, clamp); A, D: (H,) (D may be
   NULL); B, C: (rows, G, N); y: (rows, H, P). Rows with slot -1 are padding: y = 0. */
void ssm_update_f32(float *pool, int64_t slot_stride, const int64_t *slots, int64_t rows,
                    int64_t H, int64_t P, int64_t N, int64_t G, const float *x,
                    const float *dt, const float *A, const float *B, const float *C,
                    const float *D, float *y) {
    const int64_t heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < H; ++h) {
            float *out = y + (r * H + h) * P;
            const int64_t slot = slots[r];
            if (slot < 0) {
                for (int64_t p = 0; p < P; ++p) out[p] = 0.0f;
                continue;
            }
            const int64_t group = r * G + h / heads_per_group;
            ssm_update_head(pool + slot * slot_stride + h * P * N, P, N, x + (r * H + h) * P,
                            dt[r * H + h], A[h], B + group * N, C + group * N, D ? D[h] : 0.0f,
                            out);
        }
    }
}
