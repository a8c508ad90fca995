"""One decode step of the Mamba2 recurrence for a batch of rows, each with its own state slot.

Triton version of `kernels.reference.state_update.selective_state_update_ref`, after mamba_ssm's
`selective_state_update` with `HAS_STATE_BATCH_INDICES`. One program owns a (BLOCK_P, N) block of
one row's state for one head: it reads the block from the slot pool, advances it, writes it back in
place and reduces it against C into BLOCK_P outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import strides


@triton.heuristics(
    {
        "HAS_D": lambda args: args["D"] is not None,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
    }
)
@triton.jit
def _selective_state_update_kernel(
    # Pointers
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
    # Dimensions and scalars
    P,
    N,
    heads_per_group,
    dt_min,
    dt_max,
    # Strides
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    stride_s_n,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_A_h,
    stride_B_b,
    stride_B_g,
    stride_B_n,
    stride_C_b,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_dt_bias_h,
    stride_slots_b,
    stride_o_b,
    stride_o_h,
    stride_o_p,
    # Meta-parameters
    DT_SOFTPLUS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // heads_per_group
    i_b64 = i_b.to(tl.int64)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    mask_p = o_p < P
    mask_n = o_n < N
    p_o = out + i_b64 * stride_o_b + i_h * stride_o_h + o_p * stride_o_p

    i_slot = tl.load(state_slots + i_b64 * stride_slots_b).to(tl.int64)
    if i_slot < 0:
        # Skip padding rows: the pool is neither read nor written, the output is zero.
        tl.store(p_o, tl.zeros([BLOCK_P], dtype=p_o.dtype.element_ty), mask=mask_p)
        return

    mask_s = mask_p[:, None] & mask_n[None, :]
    p_s = (
        ssm_states
        + i_slot * stride_s_slot
        + i_h * stride_s_h
        + o_p[:, None] * stride_s_p
        + o_n[None, :] * stride_s_n
    )
    b_s = tl.load(p_s, mask=mask_s, other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_N)
    b_x = tl.load(x + i_b64 * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=mask_p)
    b_x = b_x.to(tl.float32)
    p_B = B + i_b64 * stride_B_b + i_g * stride_B_g + o_n * stride_B_n
    p_C = C + i_b64 * stride_C_b + i_g * stride_C_g + o_n * stride_C_n
    b_B = tl.load(p_B, mask=mask_n, other=0.0).to(tl.float32)
    b_C = tl.load(p_C, mask=mask_n, other=0.0).to(tl.float32)

    # dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max), as in `prepare_dt`.
    b_dt = tl.load(dt + i_b64 * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias + i_h * stride_dt_bias_h).to(tl.float32)
    if DT_SOFTPLUS:
        # NOTE: torch's softplus returns x itself above threshold 20.
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    b_A = tl.load(A + i_h * stride_A_h).to(tl.float32)

    # S = exp(dt' A) S + dt' x B^T;  y = S C + D x
    b_s = b_s * tl.exp(b_dt * b_A) + (b_dt * b_x)[:, None] * b_B[None, :]
    tl.store(p_s, b_s.to(p_s.dtype.element_ty), mask=mask_s)
    b_y = tl.sum(b_s * b_C[None, :], axis=1)  # (BLOCK_P,)
    if HAS_D:
        b_y += tl.load(D + i_h * stride_D_h).to(tl.float32) * b_x
    tl.store(p_o, b_y.to(p_o.dtype.element_ty), mask=mask_p)


def _block_p_and_warps(N: int) -> tuple[int, int]:
    """Keep the state block near 512-1024 floats, as mamba_ssm does: larger N, fewer rows of P."""
    if N <= 16:
        return 32, 4
    if N <= 32:
        return 16, 4
    if N <= 64:
        return 8, 4
    if N <= 128:
        return 4, 4
    return 4, 8


def _selective_state_update_fwd(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    Bt, H, P = x.shape
    G, N = B.shape[-2:]
    assert ssm_states.dim() == 4 and ssm_states.shape[1:] == (H, P, N), ssm_states.shape
    assert dt.shape == (Bt, H) and A.shape == (H,)
    assert B.shape == (Bt, G, N) and C.shape == (Bt, G, N)
    assert H % G == 0, f"nheads {H} is not a multiple of n_groups {G}"
    assert state_slots.shape == (Bt,) and not state_slots.is_floating_point()
    assert D is None or D.shape == (H,)
    assert dt_bias is None or dt_bias.shape == (H,)
    assert dt_limit[0] <= dt_limit[1], dt_limit

    out = torch.empty((Bt, H, P), dtype=x.dtype, device=x.device)
    if Bt == 0:
        return out
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_P, num_warps = _block_p_and_warps(N)
    BLOCK_P = min(BLOCK_P, triton.next_power_of_2(P))
    grid = (Bt, H, triton.cdiv(P, BLOCK_P))
    _selective_state_update_kernel[grid](
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
        P=P,
        N=N,
        heads_per_group=H // G,
        dt_min=float(dt_limit[0]),
        dt_max=float(dt_limit[1]),
        **strides("s", ssm_states, "slot", "h", "p", "n"),
        **strides("x", x, "b", "h", "p"),
        **strides("dt", dt, "b", "h"),
        **strides("A", A, "h"),
        **strides("B", B, "b", "g", "n"),
        **strides("C", C, "b", "g", "n"),
        **strides("D", D, "h"),
        **strides("dt_bias", dt_bias, "h"),
        **strides("slots", state_slots, "b"),
        **strides("o", out, "b", "h", "p"),
        DT_SOFTPLUS=dt_softplus,
        BLOCK_P=BLOCK_P,
        BLOCK_N=BLOCK_N,
        num_warps=num_warps,
    )
    return out


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
    """Advance each row's state by one token and return that token's output.

    Shapes (Bt rows, H heads, P head dim, G groups, N state size):
        ssm_states: (num_slots, H, P, N), any strides (e.g. `pool[:, layer]`), updated in place
        x: (Bt, H, P); dt: (Bt, H), raw, before dt_bias and softplus; A: (H,)
        B, C: (Bt, G, N); head h uses group h // (H // G)
        state_slots: (Bt,) int; -1 marks a padding row
        D: (H,); dt_bias: (H,)
    Returns (Bt, H, P) in x.dtype:
        S = exp(dt' * A) * S + dt' * outer(x, B);  y = S @ C + D * x,
    with dt' = clamp(softplus(dt + dt_bias), *dt_limit), all in float32; the state is stored
    back in the pool's dtype. Padding rows leave the pool untouched and output zeros. Rows must
    use distinct slots (two programs writing one slot would race).
    """
    return _selective_state_update_fwd(
        ssm_states, x, dt, A, B, C, state_slots, D, dt_bias, dt_softplus, dt_limit
    )
