"""The Mamba1 selective scan (Jamba) in Triton: the prompt scan and the decode step.

Triton versions of `kernels.reference.mamba1`. One program owns a (BLOCK_D, N) block of one
sequence's (or decode row's) state: channels never interact, so the state stays in registers
while the prompt scan walks its sequence token by token, reading one row of x and dt and the
token's B and C per step. The block is read from its slot once and written back once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import strides


@triton.jit
def _advance(b_h, b_x, b_dt, b_A, b_B, b_C):
    """One token: (h, y) for a (BLOCK_D, BLOCK_N) state block; b_dt is Δ after softplus."""
    b_h = tl.exp(b_dt[:, None] * b_A) * b_h + (b_dt * b_x)[:, None] * b_B[None, :]
    return b_h, tl.sum(b_h * b_C[None, :], axis=1)


@triton.jit
def _delta(dt, dt_bias, o_d, mask_d, HAS_DT_BIAS: tl.constexpr):
    b_dt = tl.load(dt + o_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias + o_d, mask=mask_d, other=0.0).to(tl.float32)
    # NOTE: torch's softplus returns x itself above threshold 20.
    return tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)


@triton.heuristics(
    {
        "HAS_D": lambda args: args["D"] is not None,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
    }
)
@triton.jit
def _scan_kernel(
    ssm_states,
    x,
    dt,
    A,
    B,
    C,
    D,
    dt_bias,
    cu_seqlens,
    initial_slots,
    final_slots,
    out,
    channels,
    N,
    stride_s_slot,
    stride_s_d,
    stride_x_t,
    stride_dt_t,
    stride_A_d,
    stride_B_t,
    stride_C_t,
    stride_o_t,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_s, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    mask_d, mask_n = o_d < channels, o_n < N
    mask_h = mask_d[:, None] & mask_n[None, :]
    o_h = o_d[:, None] * stride_s_d + o_n[None, :]
    b_A = tl.load(A + o_d[:, None] * stride_A_d + o_n[None, :], mask=mask_h, other=0.0)
    b_A = b_A.to(tl.float32)
    b_D = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_D:
        b_D = tl.load(D + o_d, mask=mask_d, other=0.0).to(tl.float32)

    first = tl.load(initial_slots + i_s).to(tl.int64)
    b_h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    if first >= 0:
        b_h = tl.load(ssm_states + first * stride_s_slot + o_h, mask=mask_h, other=0.0)
        b_h = b_h.to(tl.float32)
    start = tl.load(cu_seqlens + i_s).to(tl.int64)
    end = tl.load(cu_seqlens + i_s + 1).to(tl.int64)
    for t in range(start, end):
        b_x = tl.load(x + t * stride_x_t + o_d, mask=mask_d, other=0.0).to(tl.float32)
        b_dt = _delta(dt + t * stride_dt_t, dt_bias, o_d, mask_d, HAS_DT_BIAS)
        b_B = tl.load(B + t * stride_B_t + o_n, mask=mask_n, other=0.0).to(tl.float32)
        b_C = tl.load(C + t * stride_C_t + o_n, mask=mask_n, other=0.0).to(tl.float32)
        b_h, b_y = _advance(b_h, b_x, b_dt, b_A, b_B, b_C)
        p_o = out + t * stride_o_t + o_d
        tl.store(p_o, (b_y + b_D * b_x).to(p_o.dtype.element_ty), mask=mask_d)
    last = tl.load(final_slots + i_s).to(tl.int64)
    if last >= 0:
        p_h = ssm_states + last * stride_s_slot + o_h
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)


@triton.heuristics(
    {
        "HAS_D": lambda args: args["D"] is not None,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
    }
)
@triton.jit
def _step_kernel(
    ssm_states,
    x,
    dt,
    A,
    B,
    C,
    D,
    dt_bias,
    state_slots,
    out,
    channels,
    N,
    stride_s_slot,
    stride_s_d,
    stride_x_b,
    stride_dt_b,
    stride_A_d,
    stride_B_b,
    stride_C_b,
    stride_o_b,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    mask_d, mask_n = o_d < channels, o_n < N
    p_o = out + i_b * stride_o_b + o_d
    slot = tl.load(state_slots + i_b).to(tl.int64)
    if slot < 0:
        # Padding row: the pool is neither read nor written, the output is zero.
        tl.store(p_o, tl.zeros([BLOCK_D], dtype=p_o.dtype.element_ty), mask=mask_d)
        return
    mask_h = mask_d[:, None] & mask_n[None, :]
    p_h = ssm_states + slot * stride_s_slot + o_d[:, None] * stride_s_d + o_n[None, :]
    b_h = tl.load(p_h, mask=mask_h, other=0.0).to(tl.float32)
    b_A = tl.load(A + o_d[:, None] * stride_A_d + o_n[None, :], mask=mask_h, other=0.0)
    b_x = tl.load(x + i_b * stride_x_b + o_d, mask=mask_d, other=0.0).to(tl.float32)
    b_dt = _delta(dt + i_b * stride_dt_b, dt_bias, o_d, mask_d, HAS_DT_BIAS)
    b_B = tl.load(B + i_b * stride_B_b + o_n, mask=mask_n, other=0.0).to(tl.float32)
    b_C = tl.load(C + i_b * stride_C_b + o_n, mask=mask_n, other=0.0).to(tl.float32)
    b_h, b_y = _advance(b_h, b_x, b_dt, b_A.to(tl.float32), b_B, b_C)
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
    if HAS_D:
        b_y += tl.load(D + o_d, mask=mask_d, other=0.0).to(tl.float32) * b_x
    tl.store(p_o, b_y.to(p_o.dtype.element_ty), mask=mask_d)


def _blocks(N: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): a state block of about 1024 floats, as the Mamba2 step keeps."""
    block_n = triton.next_power_of_2(N)
    return max(16, 1024 // block_n), block_n


def _contiguous_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels step along the last dim with stride 1."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


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
    """`mamba1_scan_ref` (same arguments, output and final states)."""
    T, channels = x.shape
    N = A.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    assert dt.shape == (T, channels) and A.shape == (channels, N)
    assert B.shape == (T, N) and C.shape == (T, N)
    assert ssm_states.shape[1:] == (channels, N) and ssm_states.stride(-1) == 1
    out = torch.empty_like(x)
    if T == 0:
        return out
    x, dt, A, B, C = _contiguous_rows(x, dt, A, B, C)
    block_d, block_n = _blocks(N)
    _scan_kernel[(num_seqs, triton.cdiv(channels, block_d))](
        ssm_states=ssm_states,
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        D=D,
        dt_bias=dt_bias,
        cu_seqlens=cu_seqlens,
        initial_slots=initial_state_slots,
        final_slots=final_state_slots,
        out=out,
        channels=channels,
        N=N,
        **strides("s", ssm_states, "slot", "d"),
        **strides("x", x, "t"),
        **strides("dt", dt, "t"),
        **strides("A", A, "d"),
        **strides("B", B, "t"),
        **strides("C", C, "t"),
        **strides("o", out, "t"),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return out


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
    """`mamba1_step_ref` (same arguments, output and state updates)."""
    rows, channels = x.shape
    N = A.shape[1]
    assert ssm_states.shape[1:] == (channels, N) and ssm_states.stride(-1) == 1
    assert dt.shape == x.shape and B.shape == (rows, N) and C.shape == B.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    x, dt, A, B, C = _contiguous_rows(x, dt, A, B, C)
    block_d, block_n = _blocks(N)
    _step_kernel[(rows, triton.cdiv(channels, block_d))](
        ssm_states=ssm_states,
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        D=D,
        dt_bias=dt_bias,
        state_slots=state_slots,
        out=out,
        channels=channels,
        N=N,
        **strides("s", ssm_states, "slot", "d"),
        **strides("x", x, "b"),
        **strides("dt", dt, "b"),
        **strides("A", A, "d"),
        **strides("B", B, "b"),
        **strides("C", C, "b"),
        **strides("o", out, "b"),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return out
