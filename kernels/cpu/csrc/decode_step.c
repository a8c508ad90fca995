#include "attend.h"
#include "dot.h"
#include "fp8.h"
#include "gated_delta_head.h"
#include "ssm_update_head.h"

#include <omp.h>

enum { KIND_MAMBA = 0, KIND_ATTENTION = 1, KIND_MLP = 2, KIND_GDN = 3, KIND_SHORT_CONV = 4 };
enum { ACT_NONE = 0, ACT_SILU = 1, ACT_RELU2 = 2, ACT_GELU = 3 };
/* how Mamba2's scan output meets its gate (MambaSpec.gate) */
enum { GATE_NORM_AFTER = 0, GATE_NORM_BEFORE = 1, GATE_NO_NORM = 2 };

typedef struct {
    const float *weight, *bias; /* (rows, cols) row-major; bias (rows,) or NULL */
    int64_t rows, cols;
    /* an FP8 weight instead of `weight` (fp8.h): bytes (rows, cols), scale per group */
    const uint8_t *fp8;
    const float *scale;
    int64_t group;
} Linear;

typedef struct {
    int64_t kind, cache_index;
    const float *norm;
    Linear in[3]; /* mamba: in_proj; gdn: in_proj, in_proj_ba; attention: q, k, v; mlp: up or
                     [gate | up]; short conv: in_proj */
    Linear out;   /* out_proj, o_proj or down_proj */
    /* mamba (and gdn: conv_weight, dt_bias, A, gate_norm, conv_kernel, gate_eps; short conv:
       conv_weight, conv_bias, conv_kernel) */
    const float *conv_weight, *conv_bias, *dt_bias, *A, *D, *gate_norm;
    int64_t heads, head_dim, groups, state_size, conv_kernel, conv_silu;
    float gate_eps, dt_min, dt_max;
    /* attention; cos, sin: (positions, rotary_dim / 2), NULL without RoPE */
    const float *cos, *sin;
    int64_t q_heads, kv_heads, attention_head_dim, rotary_dim;
    float scale;
    /* mlp */
    int64_t gated, activation;
    /* gdn */
    int64_t key_heads, value_heads, key_head_dim, value_head_dim;
    /* gated attention: q_proj gives each head [queries | gate]; per-head q/k norms (NULL:
       none) with qk_eps */
    int64_t output_gate;
    const float *q_norm, *k_norm;
    float qk_eps;
    /* q/k norms over all heads at once (OLMo) rather than per head */
    int64_t qk_norm_all_heads;
    /* post-norm: hidden += norm(op(hidden)) rather than op(norm(hidden)) */
    int64_t post_norm;
    /* gdn: beta = beta_scale * sigmoid(b) */
    float beta_scale;
    /* mamba: GATE_* */
    int64_t gate_mode;
    /* parallel: the op reads the input of the layer before it (`layer_input`), which that
       layer keeps (keep_input) */
    int64_t parallel, keep_input;
} Layer;

typedef struct {
    int64_t num_layers, hidden_size;
    const Layer *layers;
    const float *embed, *final_norm;
    Linear lm_head;
    float embedding_multiplier, residual_multiplier, norm_eps, logits_divisor;
    /* the recurrent kind's two state tensors: the conv window, and the recurrent state
       (Mamba2's SSM state, Gated DeltaNet's key x value state) */
    float *conv_pool;
    int64_t conv_slot_stride, conv_layer_stride;
    float *state_pool;
    int64_t state_slot_stride, state_layer_stride;
    float *kv_pool;
    int64_t kv_block_stride, kv_layer_stride, kv_value_offset, block_size;
    /* scratch, one row per decode row: the residual stream and its norm (hidden_size), the
       projections (projected_size), the mixer's inner values (mixed_size) */
    float *hidden, *normed, *projected, *mixed;
    int64_t projected_size, mixed_size;
    /* the residual stream as a layer with keep_input saw it (hidden_size a row) */
    float *layer_input;
} Model;

/* The step's rows: each one token at position seq_len - 1. Rows come in lanes: the rows of
   one lane are consecutive positions of one sequence (a decode row is a lane of its own; a
   verify chunk of speculative decoding is one lane of several rows), so they share a state
   slot and advance it one after the other, as that many decode steps would. Lanes are
   independent and run in parallel. */
typedef struct {
    int64_t rows;
    const int64_t *seq_lens; /* (rows,) context including the token */
    const int64_t *tables;   /* (rows, width) KV block ids */
    int64_t width;
    const int64_t *slots;    /* (rows,) state slots */
    int64_t lanes;
    const int64_t *lane_starts; /* (lanes + 1,) lane i is rows [lane_starts[i], [i + 1]) */
} Step;

/* For each of `rows` (<= 8) input rows r (x + r * x_stride): y[r * y_stride + j] = row
   o + j of l times it, plus its bias, for the count (<= 4) rows from o. */
static inline void rows_of(const Linear *l, int64_t o, int64_t count, const float *x,
                           int64_t x_stride, float *y, int64_t y_stride, int64_t rows) {
    if (l->fp8) {
        const int64_t groups = (l->cols + l->group - 1) / l->group;
        for (int64_t j = 0; j < count; ++j)
            dot_fp8_rows(l->fp8 + (o + j) * l->cols, l->scale + (o + j) * groups, l->cols,
                         l->group, x, x_stride, rows, y + j, y_stride);
    } else {
        for (int64_t r = 0; r < rows; ++r)
            dot_rows(l->weight + o * l->cols, count, l->cols, x + r * x_stride, y + r * y_stride);
    }
    if (l->bias)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < count; ++j) y[r * y_stride + j] += l->bias[o + j];
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float activate(float x, int64_t activation) {
    switch (activation) {
        case ACT_SILU: return silu(x);
        case ACT_RELU2: return x > 0.0f ? x * x : 0.0f;
        case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        default: return x;
    }
}

/* Called by the whole team (as every function below): a thread per row normalises it. */
static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out,
                     int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        const float inverse = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inverse * weight[i];
    }
}

/* Row r of y = the `count` projections of row r of x (hidden_size apart) laid end to end
   (projected_size apart). The weights go four rows at a time (`dot_rows`), each read once
   for every decode row; the pieces of four are shared over the team in shrinking runs (a
   VM's threads often run at different speeds). */
static void project(const Model *m, const Linear *ls, int64_t count, const float *x, float *y,
                    int64_t rows) {
    int64_t pieces = 0;
    for (int64_t i = 0; i < count; ++i) pieces += (ls[i].rows + 3) / 4;
#pragma omp for schedule(guided, 8)
    for (int64_t p = 0; p < pieces; ++p) {
        /* piece p: rows 4k.. of projection i, which starts at `at` in y's row */
        int64_t i = 0, k = p, at = 0;
        while (k >= (ls[i].rows + 3) / 4) {
            k -= (ls[i].rows + 3) / 4;
            at += ls[i++].rows;
        }
        const int64_t o = 4 * k, n = ls[i].rows - o < 4 ? ls[i].rows - o : 4;
        rows_of(&ls[i], o, n, x, m->hidden_size, y + at + o, m->projected_size, rows);
    }
}

/* hidden += multiplier * (x W^T + b), x's rows mixed_size apart: the residual add inside the
   output projection. */
static void project_residual(const Model *m, const Linear *l, const float *x, int64_t rows) {
    const float multiplier = m->residual_multiplier;
#pragma omp for schedule(guided, 8)
    for (int64_t o = 0; o < l->rows; o += 4) {
        const int64_t n = l->rows - o < 4 ? l->rows - o : 4;
        float out[4 * rows];
        rows_of(l, o, n, x, m->mixed_size, out, 4, rows);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < n; ++j)
                m->hidden[r * m->hidden_size + o + j] += multiplier * out[4 * r + j];
    }
}

/* The op's input in `normed`: the residual stream (as the layer before saw it, for a parallel
   layer) normed, or (post-norm) as it is. */
static void sublayer_input(const Model *m, const Layer *l, int64_t rows) {
    const int64_t H = m->hidden_size;
    const float *x = l->parallel ? m->layer_input : m->hidden;
    if (l->keep_input) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            memcpy(m->layer_input + r * H, m->hidden + r * H, sizeof(float) * H);
    }
    if (!l->post_norm) {
        rms_norm(x, l->norm, H, m->norm_eps, m->normed, rows);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) memcpy(m->normed + r * H, x + r * H, sizeof(float) * H);
}

/* The output projection of x (rows mixed_size apart) added to the residual stream; post-norm
   normalises each whole output row first, so the rows go to `normed` (the op has read its
   input by now), then are normed and added. */
static void sublayer_output(const Model *m, const Layer *l, const float *x, int64_t rows) {
    if (!l->post_norm) {
        project_residual(m, &l->out, x, rows);
        return;
    }
    const int64_t H = m->hidden_size;
#pragma omp for schedule(guided, 8)
    for (int64_t o = 0; o < l->out.rows; o += 4) {
        const int64_t n = l->out.rows - o < 4 ? l->out.rows - o : 4;
        rows_of(&l->out, o, n, x, m->mixed_size, m->normed + o, H, rows);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *y = m->normed + r * H;
        const float inverse = 1.0f / sqrtf(dot(y, y, H) / (float)H + m->norm_eps);
        for (int64_t i = 0; i < H; ++i)
            m->hidden[r * H + i] += m->residual_multiplier * (y[i] * inverse * l->norm[i]);
    }
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's */

/* The conv window update of every row's `conv_dim` channels: the inputs start at `from` in
   a row of projected, the convolved values (SiLU where conv_silu) go to the start of a row
   of mixed, and the window (the W - 1 kept inputs, oldest first) shifts in place. */
static void conv_update(const Model *m, const Layer *l, const Step *step, int64_t from,
                        int64_t conv_dim) {
    const int64_t W = l->conv_kernel;
#pragma omp for collapse(2) schedule(static)
    for (int64_t lane = 0; lane < step->lanes; ++lane) {
        for (int64_t c = 0; c < conv_dim; ++c) {
          for (int64_t r = step->lane_starts[lane]; r < step->lane_starts[lane + 1]; ++r) {
            float *kept = m->conv_pool + step->slots[r] * m->conv_slot_stride +
                          l->cache_index * m->conv_layer_stride + c * (W - 1);
            const float input = m->projected[r * m->projected_size + from + c];
            const float *w = l->conv_weight + c * W;
            float acc = 0.0f;
            for (int64_t k = 0; k < W - 1; ++k) acc += kept[k] * w[k];
            acc += input * w[W - 1];
            if (l->conv_bias) acc += l->conv_bias[c];
            for (int64_t k = 0; k + 1 < W - 1; ++k) kept[k] = kept[k + 1];
            kept[W - 2] = input;
            m->mixed[r * m->mixed_size + c] = l->conv_silu ? silu(acc) : acc;
          }
        }
    }
}

static void mamba(const Model *m, const Layer *l, const Step *step) {
    const int64_t P = l->head_dim, N = l->state_size, rows = step->rows;
    const int64_t inner = l->heads * P, group_state = l->groups * N;
    const int64_t conv_dim = inner + 2 * group_state;
    sublayer_input(m, l, rows);
    project(m, l->in, 1, m->normed, m->projected, rows);
    /* a row of projected: z (inner) | x B C (conv_dim) | dt (heads);
       a row of mixed: x B C convolved (conv_dim) | y (inner) */
    conv_update(m, l, step, inner, conv_dim);
    const int64_t heads_per_group = l->heads / l->groups;
#pragma omp for collapse(2) schedule(static)
    for (int64_t lane = 0; lane < step->lanes; ++lane) {
        for (int64_t h = 0; h < l->heads; ++h) {
          for (int64_t r = step->lane_starts[lane]; r < step->lane_starts[lane + 1]; ++r) {
            const float *convolved = m->mixed + r * m->mixed_size;
            const float *B = convolved + inner, *C = B + group_state;
            float dt = m->projected[r * m->projected_size + inner + conv_dim + h] + l->dt_bias[h];
            dt = softplus(dt);
            dt = fminf(fmaxf(dt, l->dt_min), l->dt_max);
            const int64_t g = h / heads_per_group;
            float *states = m->state_pool + step->slots[r] * m->state_slot_stride +
                            l->cache_index * m->state_layer_stride;
            ssm_update_head(states + h * P * N, P, N, convolved + h * P, dt, l->A[h], B + g * N,
                            C + g * N, l->D ? l->D[h] : 0.0f,
                            m->mixed + r * m->mixed_size + conv_dim + h * P);
          }
        }
    }
    const int64_t group_size = inner / l->groups;
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < l->groups; ++g) {
            float *y = m->mixed + r * m->mixed_size + conv_dim + g * group_size;
            const float *z = m->projected + r * m->projected_size + g * group_size;
            if (l->gate_mode == GATE_NO_NORM) {
                for (int64_t i = 0; i < group_size; ++i) y[i] *= silu(z[i]);
            } else if (l->gate_mode == GATE_NORM_BEFORE) {
                const float inverse = 1.0f / sqrtf(dot(y, y, group_size) / (float)group_size +
                                                   l->gate_eps);
                const float *w = l->gate_norm + g * group_size;
                for (int64_t i = 0; i < group_size; ++i) y[i] = y[i] * inverse * w[i] * silu(z[i]);
            } else {
                float squares = 0.0f;
                for (int64_t i = 0; i < group_size; ++i) {
                    y[i] *= silu(z[i]);
                    squares += y[i] * y[i];
                }
                const float inverse = 1.0f / sqrtf(squares / (float)group_size + l->gate_eps);
                const float *w = l->gate_norm + g * group_size;
                for (int64_t i = 0; i < group_size; ++i) y[i] = y[i] * inverse * w[i];
            }
        }
    }
    sublayer_output(m, l, m->mixed + conv_dim, rows);
}

/* The gated short convolution (LFM2): y = C * conv(B * x), the window over B * x. */
static void short_conv(const Model *m, const Layer *l, const Step *step) {
    const int64_t channels = l->in[0].rows / 3, rows = step->rows;
    sublayer_input(m, l, rows);
    project(m, l->in, 1, m->normed, m->projected, rows);
    /* a row of projected: B | C | x, each `channels`; B * x goes where B was, the conv's input;
       a row of mixed: the convolved values, then C times them */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = m->projected + r * m->projected_size;
        for (int64_t c = 0; c < channels; ++c) row[c] *= row[2 * channels + c];
    }
    conv_update(m, l, step, 0, channels);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *C = m->projected + r * m->projected_size + channels;
        float *y = m->mixed + r * m->mixed_size;
        for (int64_t c = 0; c < channels; ++c) y[c] *= C[c];
    }
    sublayer_output(m, l, m->mixed, rows);
}

static void gdn(const Model *m, const Layer *l, const Step *step) {
    const int64_t Hk = l->key_heads, Hv = l->value_heads, Dk = l->key_head_dim;
    const int64_t Dv = l->value_head_dim, rows = step->rows, per_key = Hv / Hk;
    const int64_t key_dim = Hk * Dk, value_dim = Hv * Dv, conv_dim = 2 * key_dim + value_dim;
    sublayer_input(m, l, rows);
    project(m, l->in, 2, m->normed, m->projected, rows); /* in_proj, then in_proj_ba */
    /* a row of projected: q | k | v (conv_dim) | z (value_dim) | b (Hv) | a (Hv);
       a row of mixed: q | k | v convolved (conv_dim) | y (value_dim) */
    conv_update(m, l, step, 0, conv_dim);
#pragma omp for collapse(2) schedule(static)
    for (int64_t lane = 0; lane < step->lanes; ++lane) {
        for (int64_t h = 0; h < Hv; ++h) {
          for (int64_t r = step->lane_starts[lane]; r < step->lane_starts[lane + 1]; ++r) {
            const float *row = m->projected + r * m->projected_size;
            const float *convolved = m->mixed + r * m->mixed_size;
            const int64_t key = h / per_key;
            float qn[Dk], kn[Dk], scratch[Dv];
            gated_delta_normalise(convolved + key * Dk, convolved + key_dim + key * Dk, Dk, qn,
                                  kn);
            const float b = row[conv_dim + value_dim + h], a = row[conv_dim + value_dim + Hv + h];
            const float beta = l->beta_scale * (1.0f / (1.0f + expf(-b)));
            const float g = l->A[h] * softplus(a + l->dt_bias[h]);
            float *state = m->state_pool + step->slots[r] * m->state_slot_stride +
                           l->cache_index * m->state_layer_stride + h * Dk * Dv;
            gated_delta_advance(state, Dk, Dv, qn, kn, convolved + 2 * key_dim + h * Dv, &g, 0,
                                beta, scratch, m->mixed + r * m->mixed_size + conv_dim + h * Dv);
          }
        }
    }
    /* RMSNorm per value head, then the gate: y = norm(y) * weight * silu(z) */
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < Hv; ++h) {
            float *y = m->mixed + r * m->mixed_size + conv_dim + h * Dv;
            const float *z = m->projected + r * m->projected_size + conv_dim + h * Dv;
            const float inverse = 1.0f / sqrtf(dot(y, y, Dv) / (float)Dv + l->gate_eps);
            for (int64_t i = 0; i < Dv; ++i) y[i] = y[i] * inverse * l->gate_norm[i] * silu(z[i]);
        }
    }
    sublayer_output(m, l, m->mixed + conv_dim, rows);
}

/* The first rotary_dim dims of a head: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
static inline void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

/* x (n) RMS-normalised in place with weight (n). */
static inline void norm_in_place(float *x, const float *weight, int64_t n, float eps) {
    const float inverse = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inverse * weight[i];
}

static void attention(const Model *m, const Layer *l, const Step *step) {
    const int64_t D = l->attention_head_dim, H = l->q_heads, Hkv = l->kv_heads;
    const int64_t bs = m->block_size, rows = step->rows, group = H / Hkv;
    /* a row of projected: q (H heads) | gate (H heads, gated attention) | k (Hkv) | v (Hkv) */
    const int64_t q_size = H * D * (l->output_gate ? 2 : 1);
    sublayer_input(m, l, rows);
    project(m, l->in, 3, m->normed, m->projected, rows);
    if (l->output_gate || l->q_norm) {
        /* q_proj gives each head [queries | gate]: queries first, then gates, per row; then
           the per-head q and k norms */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            float *row = m->projected + r * m->projected_size;
            if (l->output_gate) {
                float heads[q_size];
                memcpy(heads, row, sizeof(float) * q_size);
                for (int64_t h = 0; h < H; ++h) {
                    memcpy(row + h * D, heads + 2 * h * D, sizeof(float) * D);
                    memcpy(row + (H + h) * D, heads + (2 * h + 1) * D, sizeof(float) * D);
                }
            }
            if (l->q_norm && l->qk_norm_all_heads) {
                norm_in_place(row, l->q_norm, H * D, l->qk_eps);
                norm_in_place(row + q_size, l->k_norm, Hkv * D, l->qk_eps);
            } else if (l->q_norm) {
                for (int64_t h = 0; h < H; ++h) norm_in_place(row + h * D, l->q_norm, D, l->qk_eps);
                for (int64_t g = 0; g < Hkv; ++g)
                    norm_in_place(row + q_size + g * D, l->k_norm, D, l->qk_eps);
            }
        }
    }
    if (l->cos) {
        const int64_t half = l->rotary_dim / 2;
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t h = 0; h < H + Hkv; ++h) {
                const int64_t at = (step->seq_lens[r] - 1) * half;
                /* query heads, then (past the gates) key heads */
                const int64_t head = h < H ? h * D : q_size + (h - H) * D;
                rotate(m->projected + r * m->projected_size + head, l->cos + at, l->sin + at,
                       half);
            }
        }
    }
    float *key = m->kv_pool + l->cache_index * m->kv_layer_stride;
    float *value = key + m->kv_value_offset;
    /* every row's K and V first: a row attends over the rows of its lane before it */
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t position = step->seq_lens[r] - 1;
            const int64_t *table = step->tables + r * step->width;
            const float *k = m->projected + r * m->projected_size + q_size, *v = k + Hkv * D;
            const int64_t at = table[position / bs] * m->kv_block_stride +
                               (g * bs + position % bs) * D;
            memcpy(key + at, k + g * D, sizeof(float) * D);
            memcpy(value + at, v + g * D, sizeof(float) * D);
        }
    }
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t *table = step->tables + r * step->width;
            const float *q = m->projected + r * m->projected_size;
            float *out = m->mixed + r * m->mixed_size + g * group * D;
            attend_group(q + g * group * D, key, value, m->kv_block_stride, table,
                         step->seq_lens[r], g, group, D, bs, l->scale, out);
            if (l->output_gate) {
                const float *gate = q + H * D + g * group * D;
                for (int64_t i = 0; i < group * D; ++i) out[i] /= 1.0f + expf(-gate[i]);
            }
        }
    }
    sublayer_output(m, l, m->mixed, rows);
}

static void mlp(const Model *m, const Layer *l, const Step *step) {
    const Linear *in = &l->in[0];
    const int64_t size = l->gated ? in->rows / 2 : in->rows, rows = step->rows;
    sublayer_input(m, l, rows);
#pragma omp for schedule(guided, 8)
    for (int64_t o = 0; o < size; o += 4) {
        const int64_t n = size - o < 4 ? size - o : 4;
        float up[4 * rows]; /* gated: y is the gate, then act(gate) * up */
        rows_of(in, o, n, m->normed, m->hidden_size, m->mixed + o, m->mixed_size, rows);
        if (l->gated) rows_of(in, size + o, n, m->normed, m->hidden_size, up, 4, rows);
        for (int64_t r = 0; r < rows; ++r) {
            float *y = m->mixed + r * m->mixed_size + o;
            for (int64_t j = 0; j < n; ++j)
                y[j] = activate(y[j], l->activation) * (l->gated ? up[4 * r + j] : 1.0f);
        }
    }
    sublayer_output(m, l, m->mixed, rows);
}

/* Whether logit v beats `best` (at a lower index) in torch.argmax's order: a NaN beats any
   number, and among equals the first wins. */
static inline int beats(float v, float best) { return v > best || (v != v && best == best); }

/* The step's decode rows, `tokens` (rows,); writes their logits (rows, lm_head rows), divided
   by logits_divisor, to `out`, and each row's greedy token (its argmax, as torch.argmax) to
   `greedy` (rows,). Each thread keeps the best of the logits it wrote while they are in its
   cache (read back by another core they cost ~35 us a step); one thread then compares the
   threads' bests. */
void decode_rows(const Model *m, const Step *step, const int64_t *tokens, float *out,
                 int64_t *greedy) {
    const int64_t H = m->hidden_size, vocab = m->lm_head.rows, rows = step->rows;
    const int threads = omp_get_max_threads();
    float best_value[threads * rows];
    int64_t best_index[threads * rows];
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < H; ++i)
                m->hidden[r * H + i] = m->embed[tokens[r] * H + i] * m->embedding_multiplier;
        for (int64_t i = 0; i < m->num_layers; ++i) {
            const Layer *l = &m->layers[i];
            if (l->kind == KIND_MAMBA)
                mamba(m, l, step);
            else if (l->kind == KIND_GDN)
                gdn(m, l, step);
            else if (l->kind == KIND_SHORT_CONV)
                short_conv(m, l, step);
            else if (l->kind == KIND_ATTENTION)
                attention(m, l, step);
            else
                mlp(m, l, step);
        }
        rms_norm(m->hidden, m->final_norm, H, m->norm_eps, m->normed, rows);
        /* this thread's best per row; its pieces come in increasing order (a dynamic
           schedule hands them out in order), so the first of equals stays */
        float *value = best_value + omp_get_thread_num() * rows;
        int64_t *index = best_index + omp_get_thread_num() * rows;
        for (int64_t r = 0; r < rows; ++r) index[r] = -1;
#pragma omp for schedule(guided, 8)
        for (int64_t o = 0; o < vocab; o += 4) {
            const int64_t n = vocab - o < 4 ? vocab - o : 4;
            rows_of(&m->lm_head, o, n, m->normed, H, out + o, vocab, rows);
            for (int64_t r = 0; r < rows; ++r) {
                float *y = out + r * vocab + o;
                if (m->logits_divisor != 1.0f)
                    for (int64_t j = 0; j < n; ++j) y[j] /= m->logits_divisor;
                for (int64_t j = 0; j < n; ++j)
                    if (index[r] < 0 || beats(y[j], value[r])) {
                        value[r] = y[j];
                        index[r] = o + j;
                    }
            }
        }
#pragma omp single nowait
        for (int64_t r = 0; r < rows; ++r) {
            int64_t pick = -1;
            float pick_value = 0.0f;
            for (int t = 0; t < omp_get_num_threads(); ++t) {
                const int64_t i = best_index[t * rows + r];
                const float v = best_value[t * rows + r];
                if (i >= 0 && (pick < 0 || beats(v, pick_value) ||
                               (!beats(pick_value, v) && i < pick))) {
                    pick = i;
                    pick_value = v;
                }
            }
            greedy[r] = pick;
        }
    }
}
