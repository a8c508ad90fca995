#include "ssm_update_head.h"

#include <string.h>

/* x: (T, H, P); dt: (T, H) prepared; A, D: (H,) (D may be NULL); B, C: (T, G, N);
   offsets: (S + 1,) token offsets; initial, final: (S,) slots, -1 = zero start / no write;
   pool: slot s's (H, P, N) state starts s * slot_stride floats in; scratch: (S, H, P, N).
   Requested states: K rows, `position_order` lists them by sequence then position,
   position_seq and position_len (tokens scanned) per row, written to position_states
   (K, H, P, N). y: (T, H, P). */
void ssm_scan_f32(const float *x, const float *dt, const float *A, const float *D,
                  const float *B, const float *C, int64_t H, int64_t P, int64_t N, int64_t G,
                  const int64_t *offsets, int64_t S, const int64_t *initial,
                  const int64_t *final, float *pool, int64_t slot_stride, float *scratch,
                  int64_t K, const int64_t *position_order, const int64_t *position_seq,
                  const int64_t *position_len, float *position_states, float *y) {
    const int64_t state = P * N, heads_per_group = H / G;
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h) {
                float *own = scratch + (s * H + h) * state;
                if (initial[s] < 0)
                    memset(own, 0, sizeof(float) * state);
                else
                    memcpy(own, pool + initial[s] * slot_stride + h * state,
                           sizeof(float) * state);
            }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h) {
                float *own = scratch + (s * H + h) * state;
                const float skip = D ? D[h] : 0.0f;
                int64_t next = 0; /* the next requested row of this sequence */
                while (next < K && position_seq[position_order[next]] != s) ++next;
                for (int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
                    const int64_t g = t * G + h / heads_per_group;
                    ssm_update_head(own, P, N, x + (t * H + h) * P, dt[t * H + h], A[h],
                                    B + g * N, C + g * N, skip, y + (t * H + h) * P);
                    while (next < K && position_seq[position_order[next]] == s &&
                           position_len[position_order[next]] == t + 1 - offsets[s]) {
                        memcpy(position_states + (position_order[next] * H + h) * state, own,
                               sizeof(float) * state);
                        ++next;
                    }
                }
            }
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h)
                if (final[s] >= 0)
                    memcpy(pool + final[s] * slot_stride + h * state,
                           scratch + (s * H + h) * state, sizeof(float) * state);
    }
}
