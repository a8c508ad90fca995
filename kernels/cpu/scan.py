"""The Mamba2 prompt scan on the CPU as the plain recurrence, token by token: a small C kernel.

The torch reference computes the scan in its chunked (SSD) form: per chunk of 64 tokens a
masked quadratic form, a decay matrix, batched matmuls, then the carry from chunk to chunk. On
a GPU that turns the recurrence into matmuls; on a CPU with two cores it is ~20% of a
2048-token prefill on the benchmark checkpoint, most of it elementwise passes (exp, cumsum,
masks, products) over (chunks, heads, 64, 64) tensors. The recurrence itself,

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t);   y_t = S_t @ C_t + D * x_t

is ~2 P N flops per token and head on a (P, N) state that stays in L1: one pass over the
prompt. Each (sequence, head) runs on its own thread with `ssm_update_head`, the decode
step's kernel (kernels/cpu/state_update.py), so prefill and decode advance a state with the
same code. Every initial state is read (copied to a scratch buffer) before any final state is
written, as the reference promises; states at requested positions (snapshots inside a chunk)
are copied out as the scan passes them.

Built like the other CPU kernels (`library`); serving `mamba_chunk_scan` on the CPU
(`dispatch.CPU_KERNELS`) for fp32 states, the reference otherwise. Tests:
tests/kernels/cpu/test_scan.py.
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels.cpu import library
from hybridserve.kernels.reference import ChunkScanOutput, mamba_chunk_scan_ref
from hybridserve.kernels.reference._common import positions_by_seq, prepare_dt

_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
_ARGTYPES += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
_ARGTYPES += [ctypes.c_void_p] * 4 + [ctypes.c_void_p]


def kernel() -> ctypes._CFuncPtr | None:
    return library.function("scan.c", "ssm_scan_f32", _ARGTYPES)


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_positions: torch.Tensor | None = None,
) -> ChunkScanOutput:
    """`mamba_chunk_scan_ref` (same arguments and results; `chunk_size` does not apply to a
    token-by-token scan) through the kernel where it applies: fp32 states on the CPU, each
    slot's (H, P, N) contiguous."""
    usable = (
        kernel() is not None
        and ssm_states.device.type == "cpu"
        and ssm_states.dtype == torch.float32
        and ssm_states[0].is_contiguous()
    )
    if not usable:
        return mamba_chunk_scan_ref(
            x,
            dt,
            A,
            B,
            C,
            chunk_size=chunk_size,
            cu_seqlens=cu_seqlens,
            ssm_states=ssm_states,
            initial_state_slots=initial_state_slots,
            final_state_slots=final_state_slots,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            state_positions=state_positions,
        )
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = cu_seqlens.shape[0] - 1
    offsets = cu_seqlens.tolist()
    positions = positions_by_seq(state_positions, offsets)  # validates them
    rows = [(seq, pos, row) for seq, pairs in enumerate(positions) for row, pos in pairs]
    order = [row for _, _, row in sorted(rows)]
    K = len(rows)
    position_seq, position_len = [0] * K, [0] * K
    for seq, pos, row in rows:
        position_seq[row], position_len[row] = seq, pos

    def ints(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).contiguous()

    xs = x.contiguous().float()
    dts = prepare_dt(dt, dt_bias, dt_softplus, dt_limit).contiguous()
    As, Bs, Cs = A.contiguous().float(), B.contiguous().float(), C.contiguous().float()
    Ds = None if D is None else D.contiguous().float()
    offsets_t, initial, final = ints(offsets), ints(initial_state_slots), ints(final_state_slots)
    order_t, seq_t, len_t = ints(order), ints(position_seq), ints(position_len)
    scratch = torch.empty((S, H, P, N), dtype=torch.float32)
    position_states = torch.empty((K, H, P, N), dtype=torch.float32)
    y = torch.empty((T, H, P), dtype=torch.float32)
    run = kernel()
    assert run is not None
    run(
        xs.data_ptr(),
        dts.data_ptr(),
        As.data_ptr(),
        None if Ds is None else Ds.data_ptr(),
        Bs.data_ptr(),
        Cs.data_ptr(),
        H,
        P,
        N,
        G,
        offsets_t.data_ptr(),
        S,
        initial.data_ptr(),
        final.data_ptr(),
        ssm_states.data_ptr(),
        ssm_states.stride(0),
        scratch.data_ptr(),
        K,
        order_t.data_ptr(),
        seq_t.data_ptr(),
        len_t.data_ptr(),
        position_states.data_ptr(),
        y.data_ptr(),
    )
    requested = None if state_positions is None else position_states.to(ssm_states.dtype)
    return ChunkScanOutput(out=y.to(x.dtype), position_states=requested)
