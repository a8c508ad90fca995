/* The Mamba1 selective scan (Jamba) on the CPU: the decode step and the prompt scan. Per channel
   d and state column n, with delta = softplus(dt + dt_bias):

       h[d, n] = exp(delta[d] A[d, n]) h[d, n] + delta[d] B[n] x[d]
       y[d]    = sum_n h[d, n] C[n] + D[d] x[d]

   A state is (channels, N) floats per slot and layer, contiguous. D and dt_bias may be NULL.
   The prompt scan runs token by token, one (sequence, block of channels) per OpenMP iteration
   with the block's state in a local buffer: channels are independent, so every thread streams
   its own rows of x and dt while B and C stay in cache. */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { CHANNEL_BLOCK = 64 };

static inline float softplus(float v) {
    /* torch's softplus returns v itself above threshold 20 */
    return v > 20.0f ? v : log1pf(expf(v));
}

/* One token through channels [d0, d1): h (d1 - d0, N) advanced in place, y[d] written. */
static void advance(float *h, int64_t d0, int64_t d1, int64_t N, const float *x, const float *dt,
                    const float *A, const float *B, const float *C, const float *D,
                    const float *dt_bias, float *y) {
    for (int64_t d = d0; d < d1; ++d) {
        const float delta = softplus(dt[d] + (dt_bias ? dt_bias[d] : 0.0f));
        const float dx = delta * x[d];
        float *row = h + (d - d0) * N;
        const float *a = A + d * N;
        float acc = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
            row[n] = expf(delta * a[n]) * row[n] + dx * B[n];
            acc += row[n] * C[n];
        }
        y[d] = acc + (D ? D[d] * x[d] : 0.0f);
    }
}

/* Decode rows. pool: the layer's state of slot 0; slot s starts slot_stride floats further.
   x, dt, out: (rows, channels); B, C: (rows, N). Rows with slot -1 are padding: out = 0, the
   pool untouched. */
void mamba1_step_f32(float *pool, int64_t slot_stride, const int64_t *slots, int64_t rows,
                     int64_t channels, int64_t N, const float *x, const float *dt,
                     const float *A, const float *B, const float *C, const float *D,
                     const float *dt_bias, float *out) {
    const int64_t blocks = (channels + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t d0 = b * CHANNEL_BLOCK;
            const int64_t d1 = d0 + CHANNEL_BLOCK < channels ? d0 + CHANNEL_BLOCK : channels;
            float *o = out + r * channels;
            if (slots[r] < 0) {
                memset(o + d0, 0, (size_t)(d1 - d0) * sizeof(float));
                continue;
            }
            advance(pool + slots[r] * slot_stride + d0 * N, d0, d1, N, x + r * channels,
                    dt + r * channels, A, B + r * N, C + r * N, D, dt_bias, o);
        }
    }
}

/* Prompt sequences, packed: sequence s owns tokens [cu_seqlens[s], cu_seqlens[s + 1]). Its
   state starts from slot initial_slots[s] (-1: zero) and ends in final_slots[s] (-1: not
   written). x, dt, out: (T, channels); B, C: (T, N). A sequence may read and write one slot;
   two sequences never share one. */
void mamba1_scan_f32(float *pool, int64_t slot_stride, const int64_t *cu_seqlens,
                     int64_t num_seqs, const int64_t *initial_slots, const int64_t *final_slots,
                     int64_t channels, int64_t N, const float *x, const float *dt,
                     const float *A, const float *B, const float *C, const float *D,
                     const float *dt_bias, float *out) {
    const int64_t blocks = (channels + CHANNEL_BLOCK - 1) / CHANNEL_BLOCK;
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t d0 = b * CHANNEL_BLOCK;
            const int64_t d1 = d0 + CHANNEL_BLOCK < channels ? d0 + CHANNEL_BLOCK : channels;
            const size_t bytes = (size_t)((d1 - d0) * N) * sizeof(float);
            float h[CHANNEL_BLOCK * N];
            const int64_t first = initial_slots[s], last = final_slots[s];
            if (first >= 0)
                memcpy(h, pool + first * slot_stride + d0 * N, bytes);
            else
                memset(h, 0, bytes);
            for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t)
                advance(h, d0, d1, N, x + t * channels, dt + t * channels, A, B + t * N,
                        C + t * N, D, dt_bias, out + t * channels);
            if (last >= 0)
                memcpy(pool + last * slot_stride + d0 * N, h, bytes);
        }
    }
}
