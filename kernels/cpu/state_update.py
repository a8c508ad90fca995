"""The Mamba2 decode state update on the CPU in one pass over each state: a small C kernel.

At a few dozen decode rows a step moves more bytes through SSM states than through weights
(32 rows x 6 layers x 16 heads x 64 x 64 floats = 50 MB, read and written, against 88 MB of
weights on the benchmark checkpoint). Torch ops touch each state several times: the compiled
decode step's loop reads the pool, writes the new states to a temporary (the scatter cannot
write the pool it reads from) and copies that back, four passes; the eager ops make five or
six. This kernel reads each state once, writes it back in place and accumulates the output's
dot product in the same loop:

    S = exp(dt * A) * S + dt * outer(x, B);   y = S @ C + D * x        (per row and head)

It is C built at first use (`library`, about 0.2 s) and called through ctypes here (the
eager step); the compiled step calls it as the operator `hybridserve::ssm_update_`
(kernels/cpu/ops.py). `build()` compiles or loads it; without a compiler, or when the build
fails, `available` is False and callers run the torch reference. Tests compare the two
(tests/kernels/cpu/test_state_update.py).
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels.cpu import library
from hybridserve.kernels.reference import selective_state_update_ref
from hybridserve.kernels.reference._common import prepare_dt

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5]
_ARGTYPES += [ctypes.c_void_p] * 7


def build() -> bool:
    """Compile (or find in the cache) and load the kernel, once per process; whether it is
    usable."""
    return kernel() is not None


def kernel() -> ctypes._CFuncPtr | None:
    return library.function("state_update.c", "ssm_update_f32", _ARGTYPES)


def available(ssm_pool: torch.Tensor) -> bool:
    """Whether the kernel can update this (num_slots, num_layers, H, P, N) pool: fp32 states
    on the CPU, each (slot, layer) one contiguous (H, P, N) block, and the kernel built
    (`build`)."""
    return (
        library.loaded("state_update.c", "ssm_update_f32")
        and ssm_pool.device.type == "cpu"
        and ssm_pool.dtype == torch.float32
        and ssm_pool.dim() == 5
        and ssm_pool[0, 0].is_contiguous()
    )


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """`selective_state_update_ref` (same arguments; ssm_states is one layer's (num_slots, H,
    P, N) view of the pool) through the kernel where it applies, else the reference."""
    if not (build() and available(ssm_states.unsqueeze(1))):
        return selective_state_update_ref(
            ssm_states,
            x,
            dt,
            A,
            B,
            C,
            state_slots=state_slots,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    return _update(ssm_states, x, dt, A, B, C, state_slots, D).to(x.dtype)


def _update(
    layer_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel on one layer's (num_slots, H, P, N) states, dt prepared; fp32 y."""
    run = kernel()
    assert run is not None, "the kernel before build(): check available() first"
    rows, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x, dt, A = (t.contiguous().float() for t in (x, dt, A))
    B, C = B.contiguous().float(), C.contiguous().float()
    slots = slots.contiguous().long()
    D = None if D is None else D.contiguous().float()
    y = torch.empty((rows, H, P), dtype=torch.float32)
    run(
        layer_states.data_ptr(),
        layer_states.stride(0),
        slots.data_ptr(),
        rows,
        H,
        P,
        N,
        G,
        x.data_ptr(),
        dt.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        None if D is None else D.data_ptr(),
        y.data_ptr(),
    )
    return y
