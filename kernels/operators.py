"""The kernels that are torch operators: the GEMM on a CPU-packed weight, and the decode-row
kernels that read or write one layer of a state pool.

    hybridserve::packed_linear(x, weight, bias)                  y = x weight^T + bias
    hybridserve::conv_update_(conv_pool!, layer, x, weight, bias, slots, activation)
    hybridserve::ssm_update_(ssm_pool!, layer, x, dt, A, B, C, slots, D)      dt prepared
    hybridserve::gated_delta_update_(state_pool!, layer, q, k, v, g, beta, slots)
    hybridserve::mamba1_update_(ssm_pool!, layer, x, dt, A, B, C, slots, D, dt_bias)
    hybridserve::store_kv_(kv_pool!, layer, key, value, slot_mapping)
    hybridserve::attention_decode(q, kv_pool, layer, block_tables, seq_lens, scale)

Why operators: a step that `torch.compile` traces must write the pools in place, and a write
through a per-layer view of a graph input makes the compiler scatter the view back into the
whole pool every step (200 ms a step on the benchmark model). An operator declared as
mutating its pool is one opaque call that the compiler keeps in place; eager steps call the
same operators, so no layer asks whether it is being compiled.

Their reference (registered for every device) runs the dispatched kernel of the same job on
the layer's view of the pool: Triton on CUDA, the C kernel or torch on the CPU
(dispatch.py). On the CPU their C++ implementations (csrc/ops.cpp, built by cpu/ops.py)
replace it once built: the generated code of a compiled step then calls C++ directly, where a
Python implementation cost 10-20 us a call.

A packed weight is found by the plain weight's address (`register_packed`), not passed to
the operator: the compiler cannot trace oneDNN's opaque packed tensors, and with the address
every engine of one model compiles the same graph.
"""

from __future__ import annotations

import threading
import weakref

import torch

from hybridserve.kernels.dispatch import dispatched
from hybridserve.kernels.reference._common import prepare_dt

_LIBRARY = torch.library.Library("hybridserve", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "conv_update_(Tensor(a!) conv_pool, int layer, Tensor x, Tensor weight, Tensor? bias, "
    "Tensor slots, str? activation) -> Tensor"
)
_LIBRARY.define(
    "ssm_update_(Tensor(a!) ssm_pool, int layer, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor slots, Tensor? D) -> Tensor"
)
_LIBRARY.define(
    "gated_delta_update_(Tensor(a!) state_pool, int layer, Tensor q, Tensor k, Tensor v, "
    "Tensor g, Tensor beta, Tensor slots) -> Tensor"
)
_LIBRARY.define(
    "mamba1_update_(Tensor(a!) ssm_pool, int layer, Tensor x, Tensor dt, Tensor A, Tensor B, "
    "Tensor C, Tensor slots, Tensor? D, Tensor? dt_bias) -> Tensor"
)
_LIBRARY.define(
    "store_kv_(Tensor(a!) kv_pool, int layer, Tensor key, Tensor value, Tensor slot_mapping) -> ()"
)
_LIBRARY.define(
    "attention_decode(Tensor q, Tensor kv_pool, int layer, Tensor block_tables, "
    "Tensor seq_lens, float scale) -> Tensor"
)

_linear = dispatched("linear")
_causal_conv1d_update = dispatched("causal_conv1d_update")
_selective_state_update = dispatched("selective_state_update")
_gated_delta_step = dispatched("gated_delta_step")
_mamba1_step = dispatched("mamba1_step")
_store_kv = dispatched("store_kv")
_paged_attention_decode = dispatched("paged_attention_decode")

# ---- packed weights -----------------------------------------------------------------------

# Weight address -> (the weight, its packed copy), both weakly held: the layer that packed a
# weight owns both, and an entry whose weight or copy is gone is ignored and dropped.
_packed: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
_packed_lock = threading.Lock()


def register_packed(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """Let `packed_linear(x, weight, ...)` find `packed` while its owner keeps it alive."""
    with _packed_lock:
        for address in [a for a, (w, p) in _packed.items() if w() is None or p() is None]:
            del _packed[address]
        _packed[weight.data_ptr()] = (weakref.ref(weight), weakref.ref(packed))
    from hybridserve.kernels.cpu import ops

    ops.register_packed(weight, packed)


def _find_packed(weight: torch.Tensor) -> torch.Tensor | None:
    with _packed_lock:
        entry = _packed.get(weight.data_ptr())
    registered = entry[0]() if entry is not None else None
    if registered is None or registered.untyped_storage()._cdata != weight.untyped_storage()._cdata:
        return None  # never packed, or another weight now lives at this address
    return entry[1]()  # type: ignore[index]  (an alias of the weight shares its storage)


@torch.library.impl(_LIBRARY, "packed_linear", "CompositeExplicitAutograd")
def packed_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    packed = _find_packed(weight)
    if packed is None:
        return _linear(x, weight, bias)
    from hybridserve.kernels.cpu.gemm import linear

    return linear(x, weight, bias, packed)


@torch.library.register_fake("hybridserve::packed_linear")
def _packed_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ---- the pool operators ---------------------------------------------------------------------


@torch.library.impl(_LIBRARY, "conv_update_", "CompositeExplicitAutograd")
def conv_update_reference(
    conv_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    return _causal_conv1d_update(
        x,
        weight,
        bias,
        conv_states=conv_pool.select(1, layer),
        state_slots=slots,
        activation=activation,
    )


@torch.library.register_fake("hybridserve::conv_update_")
def _conv_update_shape(
    conv_pool: torch.Tensor, layer: int, x: torch.Tensor, *rest: object
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.impl(_LIBRARY, "ssm_update_", "CompositeExplicitAutograd")
def ssm_update_reference(
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
    y = _selective_state_update(
        ssm_pool.select(1, layer),
        x,
        dt,
        A,
        B,
        C,
        state_slots=slots,
        D=D,
        dt_bias=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),  # dt is prepared: positive, within its limits
    )
    return y.float()


@torch.library.register_fake("hybridserve::ssm_update_")
def _ssm_update_shape(
    ssm_pool: torch.Tensor, layer: int, x: torch.Tensor, *rest: object
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.impl(_LIBRARY, "gated_delta_update_", "CompositeExplicitAutograd")
def gated_delta_update_reference(
    state_pool: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    out = _gated_delta_step(state_pool.select(1, layer), q, k, v, g, beta, state_slots=slots)
    return out.float()


@torch.library.register_fake("hybridserve::gated_delta_update_")
def _gated_delta_update_shape(
    state_pool: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *rest: object,
) -> torch.Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.impl(_LIBRARY, "mamba1_update_", "CompositeExplicitAutograd")
def mamba1_update_reference(
    ssm_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> torch.Tensor:
    out = _mamba1_step(
        ssm_pool.select(1, layer), x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias
    )
    return out.float()


@torch.library.register_fake("hybridserve::mamba1_update_")
def _mamba1_update_shape(
    ssm_pool: torch.Tensor, layer: int, x: torch.Tensor, *rest: object
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.impl(_LIBRARY, "store_kv_", "CompositeExplicitAutograd")
def store_kv_reference(
    kv_pool: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    pool = kv_pool.select(1, layer)
    _store_kv(key, value, pool.select(1, 0), pool.select(1, -1), slot_mapping)


@torch.library.register_fake("hybridserve::store_kv_")
def _store_kv_shape(*args: object) -> None:
    return None


@torch.library.impl(_LIBRARY, "attention_decode", "CompositeExplicitAutograd")
def attention_decode_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    pool = kv_pool.select(1, layer)
    out = _paged_attention_decode(
        q,
        pool.select(1, 0),
        pool.select(1, -1),
        block_tables=block_tables,
        seq_lens=seq_lens,
        scale=scale,
    )
    return out.float()


@torch.library.register_fake("hybridserve::attention_decode")
def _attention_decode_shape(q: torch.Tensor, *rest: object) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


# ---- what the layers call -----------------------------------------------------------------

packed_linear = torch.ops.hybridserve.packed_linear.default


def conv_update_pooled(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_pool: torch.Tensor,
    layer: int,
    state_slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """One token per row through the causal conv, shifted into its slot's window.
    x: (Bt, C); weight: (C, W); conv_pool: (num_slots, num_layers, C, W - 1), updated in
    place at (state_slots, layer); slot -1 marks a padding row. Returns (Bt, C) in x.dtype."""
    return torch.ops.hybridserve.conv_update_(
        conv_pool, layer, x, weight, bias, state_slots, activation
    )


def state_update_pooled(
    ssm_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """One decode step of the Mamba2 recurrence per row. ssm_pool: (num_slots, num_layers, H,
    P, N), updated in place at (state_slots, layer); x: (Bt, H, P); dt: (Bt, H); A: (H,);
    B, C: (Bt, G, N). Returns (Bt, H, P) in x.dtype:
    S = exp(dt' * A) * S + dt' * outer(x, B);  y = S @ C + D * x."""
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.ops.hybridserve.ssm_update_(ssm_pool, layer, x, dt, A, B, C, state_slots, D)
    return y.to(x.dtype)


def gated_delta_update_pooled(
    state_pool: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule per row. state_pool: (num_slots, num_layers,
    Hv, Dk, Dv), updated in place at (state_slots, layer); q, k: (Bt, Hk, Dk) before L2
    normalisation; v: (Bt, Hv, Dv); g, beta: (Bt, Hv). Returns (Bt, Hv, Dv) in v.dtype."""
    out = torch.ops.hybridserve.gated_delta_update_(
        state_pool, layer, q, k, v, g, beta, state_slots
    )
    return out.to(v.dtype)


def mamba1_update_pooled(
    ssm_pool: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> torch.Tensor:
    """One decode step of the Mamba1 selective scan per row. ssm_pool: (num_slots,
    num_layers, D, N), updated in place at (state_slots, layer); x, dt: (Bt, D), dt raw;
    A: (D, N); B, C: (Bt, N). Returns (Bt, D) in x.dtype."""
    y = torch.ops.hybridserve.mamba1_update_(
        ssm_pool, layer, x, dt, A, B, C, state_slots, D, dt_bias
    )
    return y.to(x.dtype)


def store_kv_pooled(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: (T, Hkv, D) into kv_pool: (num_blocks, num_layers, planes, Hkv,
    block_size, D) at layer `layer` (two planes K and V; one, a latent cache, holds the key);
    slot_mapping: (T,) block_id * block_size + offset, -1 for a padding token."""
    torch.ops.hybridserve.store_kv_(kv_pool, layer, key, value, slot_mapping)


def attention_decode_pooled(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows' attention over layer `layer` of the KV pool. q: (Bt, H, D);
    block_tables: (Bt, max_blocks); seq_lens: (Bt,), 0 for a padding row. Returns (Bt, H, D)
    in q.dtype."""
    out = torch.ops.hybridserve.attention_decode(q, kv_pool, layer, block_tables, seq_lens, scale)
    return out.to(q.dtype)
