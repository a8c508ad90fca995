#include "attend.h"

/* q, out: (rows, H, D). key, value: block b's (Hkv, block_size, D) starts b * block_stride
   floats in. tables: (rows, width) block ids; seq_lens: (rows,) tokens to attend to.
   Block by block: the scores of the block's tokens for every query head of the group, then
   one rescale of the running sums per head and block, not per token. */
void attention_decode_f32(const float *q, const float *key, const float *value,
                          int64_t block_stride, const int64_t *tables, int64_t width,
                          const int64_t *seq_lens, int64_t rows, int64_t H, int64_t Hkv,
                          int64_t D, int64_t block_size, float scale, float *out) {
    const int64_t group = H / Hkv;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t offset = (r * H + g * group) * D;
            attend_group(q + offset, key, value, block_stride, tables + r * width, seq_lens[r],
                         g, group, D, block_size, scale, out + offset);
        }
    }
}
