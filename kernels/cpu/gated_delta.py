"""The gated delta rule on the CPU: the decode step and the prompt scan as C (csrc/gated_delta.c).

Both take the reference's arguments (reference/gated_delta.py) and fall back to it for what
they do not take: states that are not fp32 or not one contiguous (Hv, Dk, Dv) block per slot,
or no compiler. Decode reads each state once and writes it back in place; the prompt scan runs
the recurrence token by token per (sequence, value head), in parallel over them. Tests compare
both with the reference (tests/kernels/cpu/test_gated_delta.py).
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels.cpu import library
from hybridserve.kernels.reference import gated_delta_chunk_ref, gated_delta_step_ref

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_STEP_ARGS = [_PTR, _I64, _PTR, *[_I64] * 6, *[_PTR] * 6]
_SCAN_ARGS = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, *[_I64] * 5, *[_PTR] * 6]


def _step_kernel() -> ctypes._CFuncPtr | None:
    return library.function("gated_delta.c", "gated_delta_step_f32", _STEP_ARGS)


def _scan_kernel() -> ctypes._CFuncPtr | None:
    return library.function("gated_delta.c", "gated_delta_scan_f32", _SCAN_ARGS)


def _takes(states: torch.Tensor) -> bool:
    """A (num_slots, Hv, Dk, Dv) layer view the kernels can update in place."""
    return (
        states.device.type == "cpu"
        and states.dtype == torch.float32
        and states.shape[0] > 0
        and states[0].is_contiguous()
    )


def _channels(g: torch.Tensor) -> int:
    """Decay values per (token, value head): 1, or one per key channel."""
    return g.shape[2] if g.dim() == 3 else 1


def _floats(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous().float() for t in tensors]


def gated_delta_step(
    states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """`gated_delta_step_ref`, through the C kernel where it applies."""
    run = _step_kernel() if _takes(states) else None
    if run is None:
        return gated_delta_step_ref(states, q, k, v, g, beta, state_slots=state_slots)
    rows, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    q, k, vf, g, beta = _floats(q, k, v, g, beta)
    slots = state_slots.contiguous().long()
    out = torch.empty((rows, Hv, Dv), dtype=torch.float32)
    run(
        states.data_ptr(),
        states.stride(0),
        slots.data_ptr(),
        rows,
        Hk,
        Hv,
        Dk,
        Dv,
        _channels(g),
        *(t.data_ptr() for t in (q, k, vf, g, beta, out)),
    )
    return out.to(v.dtype)


def gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """`gated_delta_chunk_ref` (its output and final states), through the C scan where it
    applies; `chunk_size` shapes only the reference's form."""
    run = _scan_kernel() if _takes(states) else None
    if run is None:
        return gated_delta_chunk_ref(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu_seqlens,
            states=states,
            initial_state_slots=initial_state_slots,
            final_state_slots=final_state_slots,
            chunk_size=chunk_size,
        )
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    q, k, vf, g, beta = _floats(q, k, v, g, beta)
    offsets, first, last = (
        t.contiguous().long() for t in (cu_seqlens, initial_state_slots, final_state_slots)
    )
    out = torch.empty((T, Hv, Dv), dtype=torch.float32)
    run(
        states.data_ptr(),
        states.stride(0),
        offsets.data_ptr(),
        offsets.shape[0] - 1,
        first.data_ptr(),
        last.data_ptr(),
        Hk,
        Hv,
        Dk,
        Dv,
        _channels(g),
        *(t.data_ptr() for t in (q, k, vf, g, beta, out)),
    )
    return out.to(v.dtype)
