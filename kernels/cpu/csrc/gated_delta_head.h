#pragma once

/* One token of one value head of the gated delta rule: the per-head update shared by the
   batched kernels (gated_delta.c) and the native decode step (decode_step.c).

       S = exp(g) * S;   delta = beta * (v - S^T k);   S += k delta^T;   o = S^T q

   two passes over S (Dk x Dv, row-major): the decay while accumulating S^T k, then the
   update while accumulating S^T q, each a run over Dv contiguous floats. The decay is one
   value for the head (Gated DeltaNet, g_stride 0) or one per key channel, row i of S
   decaying by exp(g[i]) (Kimi Delta Attention, g_stride 1). */
#include <math.h>
#include <stdint.h>

#define GATED_DELTA_L2_EPS 1e-6f

/* q and k of one token's key head, normalised (q also scaled) into qn, kn. */
static inline void gated_delta_normalise(const float *q, const float *k, int64_t Dk, float *qn,
                                         float *kn) {
    float qq = 0.0f, kk = 0.0f;
    for (int64_t i = 0; i < Dk; ++i) {
        qq += q[i] * q[i];
        kk += k[i] * k[i];
    }
    const float q_scale = 1.0f / sqrtf(qq + GATED_DELTA_L2_EPS) / sqrtf((float)Dk);
    const float k_scale = 1.0f / sqrtf(kk + GATED_DELTA_L2_EPS);
    for (int64_t i = 0; i < Dk; ++i) {
        qn[i] = q[i] * q_scale;
        kn[i] = k[i] * k_scale;
    }
}

/* One token through state S (Dk x Dv); qn, kn normalised; row i decays by exp(g[i *
   g_stride]); scratch: Dv floats. */
static inline void gated_delta_advance(float *S, int64_t Dk, int64_t Dv, const float *qn,
                                       const float *kn, const float *v, const float *g,
                                       int64_t g_stride, float beta, float *scratch,
                                       float *out) {
    float *delta = scratch;
    for (int64_t j = 0; j < Dv; ++j) delta[j] = 0.0f;
    const float head_decay = expf(g[0]);
    for (int64_t i = 0; i < Dk; ++i) {
        float *row = S + i * Dv;
        const float ki = kn[i];
        const float decay = g_stride ? expf(g[i * g_stride]) : head_decay;
        for (int64_t j = 0; j < Dv; ++j) {
            row[j] *= decay;
            delta[j] += row[j] * ki;
        }
    }
    for (int64_t j = 0; j < Dv; ++j) {
        delta[j] = beta * (v[j] - delta[j]);
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < Dk; ++i) {
        float *row = S + i * Dv;
        const float ki = kn[i], qi = qn[i];
        for (int64_t j = 0; j < Dv; ++j) {
            row[j] += ki * delta[j];
            out[j] += row[j] * qi;
        }
    }
}
