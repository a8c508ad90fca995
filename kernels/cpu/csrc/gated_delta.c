/* The gated delta rule (Gated DeltaNet, Kimi Delta Attention) on the CPU: the decode step and
   the prompt scan, both the per-head update of gated_delta_head.h (per value head h, its key
   head h / (Hv / Hk); q and k L2-normalised, q scaled by Dk^-1/2). g holds g_channels values
   per (token, value head): 1 (a decay per head) or Dk (one per key channel). The prompt scan runs the recurrence token by token, one
   (sequence, value head) per OpenMP iteration, with the state in a local buffer: exact where the
   chunked form reorders sums, and on a CPU as fast at these head sizes. */
#include <stdlib.h>
#include <string.h>

#include "gated_delta_head.h"

/* Decode rows. pool: the layer's state of slot 0 (Hv, Dk, Dv per slot, contiguous); slot s
   starts slot_stride floats further. q, k: (rows, Hk, Dk); v, out: (rows, Hv, Dv); g: (rows,
   Hv, g_channels); beta: (rows, Hv). Rows with slot -1 are padding: out = 0, the pool
   untouched. */
void gated_delta_step_f32(float *pool, int64_t slot_stride, const int64_t *slots, int64_t rows,
                          int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t g_channels,
                          const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *out) {
    const int64_t per_key = Hv / Hk;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < Hv; ++h) {
            float *o = out + (r * Hv + h) * Dv;
            const int64_t slot = slots[r];
            if (slot < 0) {
                memset(o, 0, (size_t)Dv * sizeof(float));
                continue;
            }
            float qn[Dk], kn[Dk], scratch[Dv];
            const int64_t key = r * Hk + h / per_key;
            gated_delta_normalise(q + key * Dk, k + key * Dk, Dk, qn, kn);
            gated_delta_advance(pool + slot * slot_stride + h * Dk * Dv, Dk, Dv, qn, kn,
                    v + (r * Hv + h) * Dv, g + (r * Hv + h) * g_channels, g_channels > 1,
                    beta[r * Hv + h], scratch, o);
        }
    }
}

/* Prompt sequences, packed: sequence s owns tokens [cu_seqlens[s], cu_seqlens[s + 1]). Its
   state starts from slot initial_slots[s] (-1: zero) and ends in final_slots[s] (-1: not
   written). q, k: (T, Hk, Dk); v, out: (T, Hv, Dv); g: (T, Hv, g_channels); beta: (T, Hv). A
   sequence may read and write one slot; two sequences never share one. */
void gated_delta_scan_f32(float *pool, int64_t slot_stride, const int64_t *cu_seqlens,
                          int64_t num_seqs, const int64_t *initial_slots,
                          const int64_t *final_slots, int64_t Hk, int64_t Hv, int64_t Dk,
                          int64_t Dv, int64_t g_channels, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, float *out) {
    const int64_t per_key = Hv / Hk;
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t h = 0; h < Hv; ++h) {
            float *S = malloc((size_t)(Dk * Dv) * sizeof(float));
            float qn[Dk], kn[Dk], scratch[Dv];
            const int64_t first = initial_slots[s], last = final_slots[s];
            if (first >= 0)
                memcpy(S, pool + first * slot_stride + h * Dk * Dv,
                       (size_t)(Dk * Dv) * sizeof(float));
            else
                memset(S, 0, (size_t)(Dk * Dv) * sizeof(float));
            for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
                const int64_t key = t * Hk + h / per_key;
                gated_delta_normalise(q + key * Dk, k + key * Dk, Dk, qn, kn);
                gated_delta_advance(S, Dk, Dv, qn, kn, v + (t * Hv + h) * Dv,
                        g + (t * Hv + h) * g_channels, g_channels > 1, beta[t * Hv + h], scratch,
                        out + (t * Hv + h) * Dv);
            }
            if (last >= 0)
                memcpy(pool + last * slot_stride + h * Dk * Dv, S,
                       (size_t)(Dk * Dv) * sizeof(float));
            free(S);
        }
    }
}
