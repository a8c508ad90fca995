"""A whole one-row decode forward on the CPU in one C call: the layers of a hybrid model, one
OpenMP team, no Python or dispatcher between ops.

At one request a decode step streams every weight once (~80 MB on the benchmark checkpoint,
2 ms here); the compiled step spends ~0.8 ms more around its ~90 kernel calls: each call goes
through the generated Python, each of its own OpenMP parallel regions wakes the team, and
after 80 MB of weights everything else runs from cold caches. This kernel runs the same
math with one parallel region for the whole step: the mat-vecs share their rows over the
team, the small ops between them split by channel, head or group, and the team meets at one
barrier per op (~4 per layer):

    embed -> per layer: RMSNorm -> mixer -> hidden += residual_multiplier * out -> final norm

    mamba:      in_proj -> conv update (state shifted in place) -> SSM update per head
                (`ssm_update_head`, shared with kernels/cpu_state_update.py) -> gated
                RMSNorm per group -> out_proj
    attention:  q, k, v -> RoPE (optional) -> K and V written to the token's KV slot ->
                paged attention per KV head (`attend_group`, kernels/cpu_attention.py) -> o_proj
    mlp:        act(up) or act(gate) * up -> down

The model is described once (`Model`, `Layer`: weight pointers and sizes, built by
workers/native_decode.py); a step passes the token, its context length, block table and
Mamba slot, and gets the final-normed hidden state. fp32 weights and states only.
"""

from __future__ import annotations

import ctypes
import os

from hybridserve.kernels import c_library, cpu_attention, cpu_state_update
from hybridserve.kernels.dispatch import BACKEND_ENV

STEP_SOURCE = r"""
enum { KIND_MAMBA = 0, KIND_ATTENTION = 1, KIND_MLP = 2 };
enum { ACT_NONE = 0, ACT_SILU = 1, ACT_RELU2 = 2, ACT_GELU = 3 };

typedef struct {
    const float *weight, *bias; /* (rows, cols) row-major; bias (rows,) or NULL */
    int64_t rows, cols;
} Linear;

typedef struct {
    int64_t kind, cache_index;
    const float *norm;
    Linear in[3]; /* mamba: in_proj; attention: q, k, v; mlp: up or [gate | up] */
    Linear out;   /* out_proj, o_proj or down_proj */
    /* mamba */
    const float *conv_weight, *conv_bias, *dt_bias, *A, *D, *gate_norm;
    int64_t heads, head_dim, groups, state_size, conv_kernel, conv_silu;
    float gate_eps, dt_min, dt_max;
    /* attention; cos, sin: (positions, rotary_dim / 2), NULL without RoPE */
    const float *cos, *sin;
    int64_t q_heads, kv_heads, attention_head_dim, rotary_dim;
    float scale;
    /* mlp */
    int64_t gated, activation;
} Layer;

typedef struct {
    int64_t num_layers, hidden_size;
    const Layer *layers;
    const float *embed, *final_norm;
    float embedding_multiplier, residual_multiplier, norm_eps;
    float *conv_pool;
    int64_t conv_slot_stride, conv_layer_stride;
    float *ssm_pool;
    int64_t ssm_slot_stride, ssm_layer_stride;
    float *kv_pool;
    int64_t kv_block_stride, kv_layer_stride, kv_value_offset, block_size;
    /* scratch: the residual stream, its norm, the projections, the mixer's inner values */
    float *hidden, *normed, *projected, *mixed;
} Model;

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

static inline float row(const Linear *l, int64_t o, const float *x) {
    return dot(l->weight + o * l->cols, x, l->cols) + (l->bias ? l->bias[o] : 0.0f);
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

/* Called by the whole team; one thread normalises, the others wait at the barrier. */
static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
#pragma omp single
    {
        const float inverse = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inverse * weight[i];
    }
}

/* y = the `count` projections of x laid end to end; their rows shared over the team in
   shrinking pieces (a VM's threads often run at different speeds). */
static void project(const Linear *ls, int64_t count, const float *x, float *y) {
    int64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += ls[i].rows;
#pragma omp for schedule(guided, 32)
    for (int64_t o = 0; o < total; ++o) {
        int64_t i = 0, r = o;
        while (r >= ls[i].rows) r -= ls[i++].rows;
        y[o] = row(&ls[i], r, x);
    }
}

/* hidden += multiplier * (x W^T + b): the residual add inside the output projection. */
static void project_residual(const Linear *l, const float *x, float multiplier, float *hidden) {
#pragma omp for schedule(guided, 32)
    for (int64_t o = 0; o < l->rows; ++o) {
        const float out = row(l, o, x);
        hidden[o] += multiplier == 1.0f ? out : out * multiplier;
    }
}

static void mamba(const Model *m, const Layer *l, int64_t slot) {
    const int64_t P = l->head_dim, N = l->state_size, W = l->conv_kernel;
    const int64_t inner = l->heads * P, group_state = l->groups * N;
    const int64_t conv_dim = inner + 2 * group_state;
    rms_norm(m->hidden, l->norm, m->hidden_size, m->norm_eps, m->normed);
    project(l->in, 1, m->normed, m->projected);
    /* projected: z (inner) | x B C (conv_dim) | dt (heads); mixed: x B C convolved | y */
    const float *z = m->projected, *xbc = z + inner, *dt = xbc + conv_dim;
    float *convolved = m->mixed, *y = m->mixed + conv_dim;
    float *conv_state = m->conv_pool + slot * m->conv_slot_stride +
                        l->cache_index * m->conv_layer_stride;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < conv_dim; ++c) {
        /* window: the W - 1 kept inputs (oldest first), then this token's */
        float *kept = conv_state + c * (W - 1);
        const float *w = l->conv_weight + c * W;
        float acc = 0.0f;
        for (int64_t k = 0; k < W - 1; ++k) acc += kept[k] * w[k];
        acc += xbc[c] * w[W - 1];
        if (l->conv_bias) acc += l->conv_bias[c];
        for (int64_t k = 0; k + 1 < W - 1; ++k) kept[k] = kept[k + 1];
        kept[W - 2] = xbc[c];
        convolved[c] = l->conv_silu ? silu(acc) : acc;
    }
    const float *B = convolved + inner, *C = B + group_state;
    float *states = m->ssm_pool + slot * m->ssm_slot_stride + l->cache_index * m->ssm_layer_stride;
    const int64_t heads_per_group = l->heads / l->groups;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < l->heads; ++h) {
        float step = dt[h] + l->dt_bias[h];
        step = step > 20.0f ? step : log1pf(expf(step)); /* softplus, as torch's */
        step = fminf(fmaxf(step, l->dt_min), l->dt_max);
        const int64_t g = h / heads_per_group;
        ssm_update_head(states + h * P * N, P, N, convolved + h * P, step, l->A[h], B + g * N,
                        C + g * N, l->D ? l->D[h] : 0.0f, y + h * P);
    }
    const int64_t group_size = inner / l->groups;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < l->groups; ++g) {
        float *yg = y + g * group_size;
        const float *zg = z + g * group_size;
        float squares = 0.0f;
        for (int64_t i = 0; i < group_size; ++i) {
            yg[i] *= silu(zg[i]);
            squares += yg[i] * yg[i];
        }
        const float inverse = 1.0f / sqrtf(squares / (float)group_size + l->gate_eps);
        for (int64_t i = 0; i < group_size; ++i)
            yg[i] = yg[i] * inverse * l->gate_norm[g * group_size + i];
    }
    project_residual(&l->out, y, m->residual_multiplier, m->hidden);
}

/* The first rotary_dim dims of a head: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
static inline void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

static void attention(const Model *m, const Layer *l, int64_t seq_len, const int64_t *table) {
    const int64_t D = l->attention_head_dim, H = l->q_heads, Hkv = l->kv_heads;
    const int64_t position = seq_len - 1, bs = m->block_size;
    rms_norm(m->hidden, l->norm, m->hidden_size, m->norm_eps, m->normed);
    project(l->in, 3, m->normed, m->projected);
    /* projected: q (H heads) | k (Hkv) | v (Hkv): q and k adjacent, one loop rotates both */
    float *q = m->projected, *k = q + H * D, *v = k + Hkv * D;
    if (l->cos) {
        const int64_t half = l->rotary_dim / 2;
        const float *cos = l->cos + position * half, *sin = l->sin + position * half;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < H + Hkv; ++h) rotate(q + h * D, cos, sin, half);
    }
    float *key = m->kv_pool + l->cache_index * m->kv_layer_stride;
    float *value = key + m->kv_value_offset;
    const int64_t block = table[position / bs], offset = position % bs;
    const int64_t group = H / Hkv;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < Hkv; ++g) {
        /* each KV head's thread stores the token's K and V, then attends over them */
        const int64_t at = block * m->kv_block_stride + (g * bs + offset) * D;
        memcpy(key + at, k + g * D, sizeof(float) * D);
        memcpy(value + at, v + g * D, sizeof(float) * D);
        attend_group(q + g * group * D, key, value, m->kv_block_stride, table, seq_len, g, group,
                     D, bs, l->scale, m->mixed + g * group * D);
    }
    project_residual(&l->out, m->mixed, m->residual_multiplier, m->hidden);
}

static void mlp(const Model *m, const Layer *l) {
    const Linear *in = &l->in[0];
    const int64_t size = l->gated ? in->rows / 2 : in->rows;
    rms_norm(m->hidden, l->norm, m->hidden_size, m->norm_eps, m->normed);
#pragma omp for schedule(guided, 32)
    for (int64_t o = 0; o < size; ++o) {
        const float first = activate(row(in, o, m->normed), l->activation);
        m->mixed[o] = l->gated ? first * row(in, size + o, m->normed) : first;
    }
    project_residual(&l->out, m->mixed, m->residual_multiplier, m->hidden);
}

/* One decode token: `token` at position seq_len - 1, its KV blocks `table`, its Mamba
   `slot`; writes the final-normed hidden state (hidden_size) to `out`. */
void decode_one_row(const Model *m, int64_t token, int64_t seq_len, const int64_t *table,
                    int64_t slot, float *out) {
#pragma omp parallel
    {
        const float *embedded = m->embed + token * m->hidden_size;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m->hidden_size; ++i)
            m->hidden[i] = embedded[i] * m->embedding_multiplier;
        for (int64_t i = 0; i < m->num_layers; ++i) {
            const Layer *l = &m->layers[i];
            if (l->kind == KIND_MAMBA)
                mamba(m, l, slot);
            else if (l->kind == KIND_ATTENTION)
                attention(m, l, seq_len, table);
            else
                mlp(m, l);
        }
        rms_norm(m->hidden, m->final_norm, m->hidden_size, m->norm_eps, out);
    }
}
"""

SOURCE = cpu_state_update.SOURCE + cpu_attention.SOURCE + STEP_SOURCE

KIND_MAMBA, KIND_ATTENTION, KIND_MLP = 0, 1, 2
ACTIVATIONS = {None: 0, "silu": 1, "relu2": 2, "gelu": 3}

_float_p = ctypes.POINTER(ctypes.c_float)


class Linear(ctypes.Structure):
    _fields_ = [("weight", _float_p), ("bias", _float_p), ("rows", ctypes.c_int64)]
    _fields_ += [("cols", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("cache_index", ctypes.c_int64),
        ("norm", _float_p),
        ("in_", Linear * 3),
        ("out", Linear),
        *((name, _float_p) for name in ("conv_weight", "conv_bias", "dt_bias", "A", "D")),
        ("gate_norm", _float_p),
        *((name, ctypes.c_int64) for name in ("heads", "head_dim", "groups", "state_size")),
        ("conv_kernel", ctypes.c_int64),
        ("conv_silu", ctypes.c_int64),
        *((name, ctypes.c_float) for name in ("gate_eps", "dt_min", "dt_max")),
        ("cos", _float_p),
        ("sin", _float_p),
        *((name, ctypes.c_int64) for name in ("q_heads", "kv_heads", "attention_head_dim")),
        ("rotary_dim", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("gated", ctypes.c_int64),
        ("activation", ctypes.c_int64),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden_size", ctypes.c_int64),
        ("layers", ctypes.POINTER(Layer)),
        ("embed", _float_p),
        ("final_norm", _float_p),
        *((name, ctypes.c_float) for name in ("embedding_multiplier", "residual_multiplier")),
        ("norm_eps", ctypes.c_float),
        ("conv_pool", _float_p),
        ("conv_slot_stride", ctypes.c_int64),
        ("conv_layer_stride", ctypes.c_int64),
        ("ssm_pool", _float_p),
        ("ssm_slot_stride", ctypes.c_int64),
        ("ssm_layer_stride", ctypes.c_int64),
        ("kv_pool", _float_p),
        *((name, ctypes.c_int64) for name in ("kv_block_stride", "kv_layer_stride")),
        ("kv_value_offset", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        *((name, _float_p) for name in ("hidden", "normed", "projected", "mixed")),
    ]


_ARGTYPES = [ctypes.POINTER(Model), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_int64, ctypes.c_void_p]


def kernel() -> ctypes._CFuncPtr | None:
    """`decode_one_row(model, token, seq_len, table, slot, out)`, built at first use; None
    without a compiler or with HYBRIDSERVE_KERNEL_BACKEND=reference (torch everywhere)."""
    if os.environ.get(BACKEND_ENV) == "reference":
        return None
    return c_library.function("decode_step", SOURCE, "decode_one_row", _ARGTYPES)
