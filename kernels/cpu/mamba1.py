"""The Mamba1 selective scan on the CPU: the decode step and the prompt scan as C
(csrc/mamba1.c).

Both take the reference's arguments (reference/mamba1.py) and fall back to it for what they do
not take: states that are not fp32 or not one contiguous (D, N) block per slot, or no compiler.
Decode reads each state once and writes it back in place; the prompt scan runs the recurrence
token by token per (sequence, block of channels), in parallel over them. Tests compare both
with the reference (tests/kernels/cpu/test_mamba1.py).
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels.cpu import library
from hybridserve.kernels.reference.mamba1 import mamba1_scan_ref, mamba1_step_ref

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_STEP_ARGS = [_PTR, _I64, _PTR, _I64, _I64, _I64, *[_PTR] * 8]
_SCAN_ARGS = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, *[_PTR] * 8]


def _takes(ssm_states: torch.Tensor) -> bool:
    """A (num_slots, D, N) layer view the kernels can update in place."""
    return (
        ssm_states.device.type == "cpu"
        and ssm_states.dtype == torch.float32
        and ssm_states.shape[0] > 0
        and ssm_states[0].is_contiguous()
    )


def _floats(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """fp32 contiguous copies where needed; the caller keeps them alive through the call."""
    return [None if t is None else t.contiguous().float() for t in tensors]


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()  # NULL: an absent D or dt_bias


def mamba1_step(
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
) -> torch.Tensor:
    """`mamba1_step_ref`, through the C kernel where it applies."""
    run = (
        library.function("mamba1.c", "mamba1_step_f32", _STEP_ARGS) if _takes(ssm_states) else None
    )
    if run is None:
        return mamba1_step_ref(
            ssm_states, x, dt, A, B, C, state_slots=state_slots, D=D, dt_bias=dt_bias
        )
    rows, channels = x.shape
    slots = state_slots.contiguous().long()
    out = torch.empty((rows, channels), dtype=torch.float32)
    inputs = _floats(x, dt, A, B, C, D, dt_bias)
    run(
        ssm_states.data_ptr(),
        ssm_states.stride(0),
        slots.data_ptr(),
        rows,
        channels,
        A.shape[1],
        *map(_address, inputs),
        out.data_ptr(),
    )
    return out.to(x.dtype)


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mamba1_scan_ref` (its output and final states), through the C scan where it applies."""
    run = (
        library.function("mamba1.c", "mamba1_scan_f32", _SCAN_ARGS) if _takes(ssm_states) else None
    )
    if run is None:
        return mamba1_scan_ref(
            x,
            dt,
            A,
            B,
            C,
            cu_seqlens=cu_seqlens,
            ssm_states=ssm_states,
            initial_state_slots=initial_state_slots,
            final_state_slots=final_state_slots,
            D=D,
            dt_bias=dt_bias,
        )
    T, channels = x.shape
    offsets, first, last = (
        t.contiguous().long() for t in (cu_seqlens, initial_state_slots, final_state_slots)
    )
    out = torch.empty((T, channels), dtype=torch.float32)
    inputs = _floats(x, dt, A, B, C, D, dt_bias)
    run(
        ssm_states.data_ptr(),
        ssm_states.stride(0),
        offsets.data_ptr(),
        offsets.shape[0] - 1,
        first.data_ptr(),
        last.data_ptr(),
        channels,
        A.shape[1],
        *map(_address, inputs),
        out.data_ptr(),
    )
    return out.to(x.dtype)
