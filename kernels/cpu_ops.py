"""The CPU kernels as torch operators, with their CPU implementations in C++.

The compiled decode step calls three operators it cannot trace: `packed_linear` (a GEMM on a
oneDNN-packed weight, or the C mat-vec up to GEMV_ROWS rows), `ssm_update_` (the Mamba state
update in place, kernels/cpu_state_update.py) and `attention_decode` (paged decode attention,
kernels/cpu_attention.py). A one-row step makes 36 such calls. Implemented in Python, each
call went from the generated code through the dispatcher into the interpreter, which
checked, converted and unpacked its arguments before the C kernel ran: 10-20 us a call, about
0.4 ms of a 3.5-4 ms step. Here the implementations are a few lines of C++ (`SOURCE`) that
call the same C kernels. Layers with a packed weight call `packed_linear` in eager steps too
(`workers/layers/linear.packed_matmul`).

The C kernels stay plain C built by `c_library` (no torch headers, `-march=native`); the C++
is built against this process's torch (`c_library.load_torch_operators`, ~10 s the first time
on a machine, then cached) and gets the kernels' addresses once, from their ctypes handles
(`bind_cpu_kernels`). `build()` does both; the compiled decode step calls it before tracing,
and packing a weight calls it (the C++ side keeps the packed copies).

Packed weights are found by the plain weight's address, not passed to the operator: the
compiler cannot trace oneDNN's opaque packed tensors, and with the address every engine of
one model compiles the same graph (inductor's cache hits). The C++ table holds weak
references: the layer that packed a weight owns both, and an entry whose copy is gone is
ignored and dropped.

The schemas and shape functions are defined here in Python, so the operators exist (and
trace) whether or not the C++ builds; callers check `loaded()` before calling them. Without
a compiler, nothing is registered and the compiled step traces torch code instead.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from hybridserve.kernels import c_library, cpu_attention, cpu_gemm, cpu_state_update
from hybridserve.kernels.dispatch import BACKEND_ENV

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
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

/* The choice cpu_gemm.linear makes, without its Python. */
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

/* ssm_pool: (num_slots, num_layers, H, P, N) fp32, each (slot, layer) contiguous; dt
   prepared. Returns y (rows, H, P) fp32. */
at::Tensor ssm_update_(const at::Tensor &ssm_pool, int64_t layer, const at::Tensor &x,
                       const at::Tensor &dt, const at::Tensor &A, const at::Tensor &B,
                       const at::Tensor &C, const at::Tensor &slots,
                       const std::optional<at::Tensor> &D) {
    TORCH_CHECK(ssm_update, "hybridserve::ssm_update_: the C kernel is not bound");
    const at::Tensor states = ssm_pool.select(1, layer);
    const at::Tensor xs = x.contiguous().to(at::kFloat), dts = dt.contiguous().to(at::kFloat);
    const at::Tensor As = A.contiguous().to(at::kFloat), Bs = B.contiguous().to(at::kFloat);
    const at::Tensor Cs = C.contiguous().to(at::kFloat);
    const at::Tensor slot_ids = slots.contiguous().to(at::kLong);
    at::Tensor D_keep;
    const float *D_data = optional_data(D, D_keep);
    const int64_t rows = x.size(0), H = x.size(1), P = x.size(2);
    at::Tensor y = at::empty({rows, H, P}, x.options().dtype(at::kFloat));
    ssm_update(states.data_ptr<float>(), states.stride(0), slot_ids.data_ptr<int64_t>(), rows,
               H, P, B.size(2), B.size(1), xs.data_ptr<float>(), dts.data_ptr<float>(),
               As.data_ptr<float>(), Bs.data_ptr<float>(), Cs.data_ptr<float>(), D_data,
               y.data_ptr<float>());
    return y;
}

/* kv_pool: (num_blocks, num_layers, 2, Hkv, block_size, D) fp32, each block contiguous.
   Returns (rows, H, D) fp32. */
at::Tensor attention_decode(const at::Tensor &q, const at::Tensor &kv_pool, int64_t layer,
                            const at::Tensor &block_tables, const at::Tensor &seq_lens,
                            double scale) {
    TORCH_CHECK(attention_decode_kernel,
                "hybridserve::attention_decode: the C kernel is not bound");
    const at::Tensor key = kv_pool.select(1, layer).select(1, 0);
    const at::Tensor value = kv_pool.select(1, layer).select(1, 1);
    const at::Tensor qs = q.contiguous().to(at::kFloat);
    const at::Tensor tables = block_tables.contiguous().to(at::kLong);
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
    m.impl("attention_decode", &attention_decode);
}
"""

_LIBRARY = torch.library.Library("hybridserve", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "ssm_update_(Tensor(a!) ssm_pool, int layer, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor slots, Tensor? D) -> Tensor"
)
_LIBRARY.define(
    "attention_decode(Tensor q, Tensor kv_pool, int layer, Tensor block_tables, "
    "Tensor seq_lens, float scale) -> Tensor"
)


@torch.library.register_fake("hybridserve::packed_linear")
def _packed_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("hybridserve::ssm_update_")
def _ssm_update_shape(
    ssm_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.register_fake("hybridserve::attention_decode")
def _attention_decode_shape(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


# y = x weight^T + bias with weight's registered packed copy (`register_packed`).
packed_linear = torch.ops.hybridserve.packed_linear.default
# `cpu_state_update`'s kernel on layer `layer` of the pool, in place; dt prepared; fp32 y.
ssm_update_ = torch.ops.hybridserve.ssm_update_.default
# `cpu_attention`'s kernel on layer `layer` of the KV pool; fp32 output.
attention_decode = torch.ops.hybridserve.attention_decode.default

_loaded = False


@functools.cache
def build() -> bool:
    """Build (or find in the cache) the C kernels and the operators' C++, load them and bind
    the kernels, once per process; whether the operators have their CPU implementations."""
    global _loaded
    if os.environ.get(BACKEND_ENV) == "reference":  # torch everywhere
        return False
    kernels = [
        cpu_gemm.gemv_kernel(),
        cpu_state_update.kernel(),
        cpu_attention.kernel(),
    ]
    if any(kernel is None for kernel in kernels):
        return False
    if not c_library.load_torch_operators("cpu_ops", SOURCE):
        return False
    addresses = [ctypes.cast(kernel, ctypes.c_void_p).value for kernel in kernels]
    torch.ops.hybridserve.bind_cpu_kernels(*addresses, cpu_gemm.GEMV_ROWS, cpu_gemm.SMALL_BATCH)
    _loaded = True
    return True


def loaded() -> bool:
    """Whether `build()` has given the operators their CPU implementations (never builds:
    the compiled decode step's tracer asks this)."""
    return _loaded


def register_packed(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Let `packed_linear(x, weight, ...)` find `packed` while its owner keeps it alive;
    whether it can (the operators built)."""
    if not build():
        return False
    torch.ops.hybridserve.register_packed(weight, packed)
    return True
