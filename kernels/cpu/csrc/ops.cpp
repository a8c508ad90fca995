/* The CPU implementations of the torch operators of kernels/operators.py (their schemas and
   references are defined there): the C kernels of state_update.c and attention.c and the
   mat-vec of gemm.c, bound once by address (`bind_cpu_kernels`), and the conv update and KV
   store as plain loops. Each takes any input: fp32 pools whose rows are contiguous go
   straight to the kernel, anything else through an fp32 copy of what it touches. */
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>

namespace {

using Gemv = void (*)(const float *, int64_t, int64_t, const float *, int64_t, const float *,
                      float *);
using SsmUpdate = void (*)(float *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                           int64_t, int64_t, const float *, const float *, const float *,
                           const float *, const float *, const float *, float *);
using AttentionDecode = void (*)(const float *, const float *, const float *, int64_t,
                                 const int64_t *, int64_t, const int64_t *, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, float, float *);

Gemv gemv = nullptr;
SsmUpdate ssm_update = nullptr;
AttentionDecode attention_decode_kernel = nullptr;
int64_t gemv_rows = 0, small_batch = 0;

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

/* A packed copy and the storage of the weight it was packed from: an address alone could
   be reused by another weight once this one's memory is freed. The weak reference keeps the
   StorageImpl object (not its memory) alive, so no other storage can have its address. */
struct Packed {
    WeakStorage weight_storage;
    WeakTensor packed;
};
std::mutex packed_mutex;
std::unordered_map<const void *, Packed> packed_by_address;

void bind_cpu_kernels(int64_t gemv_address, int64_t ssm_update_address,
                      int64_t attention_address, int64_t gemv_max_rows,
                      int64_t packed_max_rows) {
    gemv = reinterpret_cast<Gemv>(gemv_address);
    ssm_update = reinterpret_cast<SsmUpdate>(ssm_update_address);
    attention_decode_kernel = reinterpret_cast<AttentionDecode>(attention_address);
    gemv_rows = gemv_max_rows;
    small_batch = packed_max_rows;
}

void register_packed(const at::Tensor &weight, const at::Tensor &packed) {
    std::lock_guard<std::mutex> lock(packed_mutex);
    std::erase_if(packed_by_address, [](const auto &entry) {
        return entry.second.packed.expired() || entry.second.weight_storage.expired();
    });
    packed_by_address.insert_or_assign(
        weight.data_ptr(), Packed{WeakStorage(weight.storage().getWeakStorageImpl()),
                                  WeakTensor(packed.getIntrusivePtr())});
}

at::Tensor find_packed(const at::Tensor &weight) {
    std::lock_guard<std::mutex> lock(packed_mutex);
    auto found = packed_by_address.find(weight.data_ptr());
    if (found == packed_by_address.end()) return {};
    const auto &entry = found->second;
    if (entry.weight_storage._unsafe_get_target() != weight.storage().unsafeGetStorageImpl())
        return {};  // another weight now lives at this address
    auto packed = entry.packed.lock();
    return packed ? at::Tensor(std::move(packed)) : at::Tensor();
}

const float *optional_data(const std::optional<at::Tensor> &tensor, at::Tensor &keep) {
    if (!tensor) return nullptr;
    keep = tensor->contiguous().to(at::kFloat);
    return keep.data_ptr<float>();
}

/* The choice gemm.linear makes, without its Python. */
at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &weight,
                         const std::optional<at::Tensor> &bias) {
    const bool matrix = x.dim() == 2;
    const bool float32 = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                         (!bias || bias->scalar_type() == at::kFloat);
    if (matrix && float32 && gemv && x.size(0) <= gemv_rows && weight.is_contiguous()) {
        const at::Tensor rows = x.contiguous();
        at::Tensor bias_keep;
        const float *bias_data = optional_data(bias, bias_keep);
        at::Tensor y = at::empty({rows.size(0), weight.size(0)}, x.options());
        gemv(weight.data_ptr<float>(), weight.size(0), weight.size(1), rows.data_ptr<float>(),
             rows.size(0), bias_data, y.data_ptr<float>());
        return y;
    }
    if (matrix && x.size(0) <= small_batch) {
        const at::Tensor packed = find_packed(weight);
        if (packed.defined()) {
            static auto linear_pointwise =
                c10::Dispatcher::singleton()
                    .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                    .typed<at::Tensor(const at::Tensor &, const at::Tensor &,
                                      const std::optional<at::Tensor> &, c10::string_view,
                                      c10::List<std::optional<at::Scalar>>,
                                      std::optional<c10::string_view>)>();
            return linear_pointwise.call(x, packed, bias, "none",
                                         c10::List<std::optional<at::Scalar>>(), "");
        }
    }
    return at::linear(x, weight, bias);
}

/* Rows whose slot is -1 are padding: nothing of them is read or written. */
at::Tensor valid_rows(const at::Tensor &slot_ids) {
    return at::nonzero(slot_ids.ge(0)).squeeze(1);
}

/* ssm_pool: (num_slots, num_layers, H, P, N); dt prepared. Returns y (rows, H, P) fp32. */
at::Tensor ssm_update_(at::Tensor ssm_pool, int64_t layer, const at::Tensor &x,
                       const at::Tensor &dt, const at::Tensor &A, const at::Tensor &B,
                       const at::Tensor &C, const at::Tensor &slots,
                       const std::optional<at::Tensor> &D) {
    TORCH_CHECK(ssm_update, "hybridserve::ssm_update_: the C kernel is not bound");
    at::Tensor states = ssm_pool.select(1, layer);
    const at::Tensor xs = x.contiguous().to(at::kFloat), dts = dt.contiguous().to(at::kFloat);
    const at::Tensor As = A.contiguous().to(at::kFloat), Bs = B.contiguous().to(at::kFloat);
    const at::Tensor Cs = C.contiguous().to(at::kFloat);
    at::Tensor slot_ids = slots.contiguous().to(at::kLong);
    at::Tensor D_keep;
    const float *D_data = optional_data(D, D_keep);
    const int64_t rows = x.size(0), H = x.size(1), P = x.size(2);
    at::Tensor y = at::empty({rows, H, P}, x.options().dtype(at::kFloat));
    const bool direct = states.scalar_type() == at::kFloat && states[0].is_contiguous();
    // Otherwise the rows' states in fp32, row r at index r, written back after.
    at::Tensor work = states, keep;
    if (!direct) {
        keep = valid_rows(slot_ids);
        work = states.index_select(0, slot_ids.clamp_min(0)).to(at::kFloat).contiguous();
        slot_ids = at::where(slot_ids.ge(0), at::arange(rows, slot_ids.options()), -1);
    }
    ssm_update(work.data_ptr<float>(), work.stride(0), slot_ids.data_ptr<int64_t>(), rows, H, P,
               B.size(2), B.size(1), xs.data_ptr<float>(), dts.data_ptr<float>(),
               As.data_ptr<float>(), Bs.data_ptr<float>(), Cs.data_ptr<float>(), D_data,
               y.data_ptr<float>());
    if (!direct) {
        const at::Tensor kept = slots.to(at::kLong).index_select(0, keep);
        states.index_copy_(0, kept, work.index_select(0, keep).to(states.scalar_type()));
    }
    return y;
}

/* conv_pool: (num_slots, num_layers, C, W - 1), each window oldest first; x: (rows, C);
   weight: (C, W). The window and x through the taps, then x shifted into the window.
   Returns (rows, C) in x's dtype; a padding row's output is 0. */
at::Tensor conv_update_(at::Tensor conv_pool, int64_t layer, const at::Tensor &x,
                        const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                        const at::Tensor &slots, std::optional<c10::string_view> activation) {
    const bool silu = activation.has_value() && std::string_view(*activation) == "silu";
    TORCH_CHECK(!activation.has_value() || silu,
                "hybridserve::conv_update_: activation must be 'silu' or None");
    at::Tensor states = conv_pool.select(1, layer);
    const int64_t rows = x.size(0), C = x.size(1), W = weight.size(1);
    const at::Tensor xs = x.contiguous().to(at::kFloat), ws = weight.contiguous().to(at::kFloat);
    at::Tensor bias_keep;
    const float *b = optional_data(bias, bias_keep);
    const at::Tensor slot_ids = slots.contiguous().to(at::kLong);
    const bool direct = states.scalar_type() == at::kFloat && states[0].is_contiguous();
    at::Tensor work = states, keep;
    if (!direct) {
        keep = valid_rows(slot_ids);
        work = states.index_select(0, slot_ids.clamp_min(0)).to(at::kFloat).contiguous();
    }
    at::Tensor y = at::zeros({rows, C}, x.options().dtype(at::kFloat));
    const int64_t *ids = slot_ids.data_ptr<int64_t>();
    const float *xp = xs.data_ptr<float>(), *wp = ws.data_ptr<float>();
    float *yp = y.data_ptr<float>(), *base = work.data_ptr<float>();
    const int64_t stride = work.stride(0);
    for (int64_t r = 0; r < rows; ++r) {
        if (ids[r] < 0) continue;
        float *window = base + (direct ? ids[r] : r) * stride;
        for (int64_t c = 0; c < C; ++c) {
            float *h = window + c * (W - 1);
            const float *w = wp + c * W, input = xp[r * C + c];
            float acc = input * w[W - 1];
            for (int64_t k = 0; k < W - 1; ++k) acc += h[k] * w[k];
            if (b) acc += b[c];
            yp[r * C + c] = silu ? acc / (1.0f + std::exp(-acc)) : acc;
            for (int64_t k = 0; k + 1 < W - 1; ++k) h[k] = h[k + 1];
            if (W > 1) h[W - 2] = input;
        }
    }
    if (!direct) {
        const at::Tensor kept = slot_ids.index_select(0, keep);
        states.index_copy_(0, kept, work.index_select(0, keep).to(states.scalar_type()));
    }
    return y.to(x.scalar_type());
}

/* kv_pool: (num_blocks, num_layers, planes, Hkv, block_size, D); key, value: (T, Hkv, D) into
   the positions slot_mapping names (block * block_size + offset; -1: a padding token). Two
   planes hold K and V; one (a latent cache, where V is K) holds the key alone. */
void store_kv_(at::Tensor kv_pool, int64_t layer, const at::Tensor &key, const at::Tensor &value,
               const at::Tensor &slot_mapping) {
    const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
    const int64_t block_size = kv_pool.size(4);
    const at::Tensor slot_ids = slot_mapping.contiguous().to(at::kLong);
    if (kv_pool.scalar_type() != at::kFloat || kv_pool.stride(5) != 1) {
        using at::indexing::Slice;
        const at::Tensor keep = valid_rows(slot_ids);
        const at::Tensor kept = slot_ids.index_select(0, keep);
        const at::Tensor blocks = kept.div(block_size, "floor"), offsets = kept.remainder(block_size);
        at::Tensor pool = kv_pool.select(1, layer);
        const auto dtype = kv_pool.scalar_type();
        /* into FP8 saturated at e4m3's largest value, as store_kv_ref: a plain cast makes
           anything beyond it NaN */
        const auto cast = [dtype](const at::Tensor &x) {
            return dtype == at::kFloat8_e4m3fn ? x.to(at::kFloat).clamp(-448.0, 448.0).to(dtype)
                                               : x.to(dtype);
        };
        pool.index_put_({blocks, 0, Slice(), offsets}, cast(key.index_select(0, keep)));
        if (kv_pool.size(2) > 1)
            pool.index_put_({blocks, 1, Slice(), offsets}, cast(value.index_select(0, keep)));
        return;
    }
    const int64_t planes = kv_pool.size(2);
    const at::Tensor k = key.contiguous().to(at::kFloat);
    const at::Tensor v = planes > 1 ? value.contiguous().to(at::kFloat) : k;  // one plane: K only
    const int64_t *ids = slot_ids.data_ptr<int64_t>();
    float *base = kv_pool.data_ptr<float>() + layer * kv_pool.stride(1);
    const int64_t block_stride = kv_pool.stride(0), part_stride = kv_pool.stride(2);
    const int64_t head_stride = kv_pool.stride(3), offset_stride = kv_pool.stride(4);
    const float *parts[2] = {k.data_ptr<float>(), v.data_ptr<float>()};
    for (int64_t t = 0; t < T; ++t) {
        if (ids[t] < 0) continue;
        float *at = base + ids[t] / block_size * block_stride + ids[t] % block_size * offset_stride;
        for (int64_t part = 0; part < planes; ++part)
            for (int64_t h = 0; h < Hkv; ++h)
                std::memcpy(at + part * part_stride + h * head_stride,
                            parts[part] + (t * Hkv + h) * D, sizeof(float) * D);
    }
}

/* kv_pool: (num_blocks, num_layers, planes, Hkv, block_size, D) (the last plane is V: with
   one, V is K); q: (rows, H, D); block_tables: (rows, width); seq_lens: (rows,). Returns
   (rows, H, D) fp32. */
at::Tensor attention_decode(const at::Tensor &q, const at::Tensor &kv_pool, int64_t layer,
                            const at::Tensor &block_tables, const at::Tensor &seq_lens,
                            double scale) {
    TORCH_CHECK(attention_decode_kernel,
                "hybridserve::attention_decode: the C kernel is not bound");
    at::Tensor blocks = kv_pool.select(1, layer);  // (num_blocks, planes, Hkv, block_size, D)
    at::Tensor tables = block_tables.contiguous().to(at::kLong);
    if (blocks.scalar_type() != at::kFloat || !blocks[0][0].is_contiguous()) {
        // The blocks the tables name, in fp32, and the tables renumbered to them.
        const auto [named, inverse] = at::_unique(tables.flatten(), false, true);
        blocks = blocks.index_select(0, named).to(at::kFloat).contiguous();
        tables = inverse.view_as(tables).contiguous();
    }
    const at::Tensor key = blocks.select(1, 0), value = blocks.select(1, blocks.size(1) - 1);
    const at::Tensor qs = q.contiguous().to(at::kFloat);
    const at::Tensor lens = seq_lens.contiguous().to(at::kLong);
    const int64_t rows = q.size(0), H = q.size(1), D = q.size(2);
    at::Tensor out = at::empty({rows, H, D}, q.options().dtype(at::kFloat));
    attention_decode_kernel(qs.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
                            key.stride(0), tables.data_ptr<int64_t>(), tables.size(1),
                            lens.data_ptr<int64_t>(), rows, H, key.size(1), D, key.size(2),
                            static_cast<float>(scale), out.data_ptr<float>());
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridserve, m) {
    m.def("bind_cpu_kernels(int gemv, int ssm_update, int attention_decode, int gemv_rows, "
          "int small_batch) -> ()",
          &bind_cpu_kernels);
    m.def("register_packed(Tensor weight, Tensor packed) -> ()", &register_packed);
}

TORCH_LIBRARY_IMPL(hybridserve, CPU, m) {
    m.impl("packed_linear", &packed_linear);
    m.impl("ssm_update_", &ssm_update_);
    m.impl("conv_update_", &conv_update_);
    m.impl("store_kv_", &store_kv_);
    m.impl("attention_decode", &attention_decode);
}
