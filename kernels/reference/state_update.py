"""One decode step of the Mamba2 recurrence for a batch of rows, each with its own state slot."""

from __future__ import annotations

import torch

from ._common import expand_groups, prepare_dt


def selective_state_update_ref(
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
        ssm_states: (num_slots, H, P, N), updated in place
        x: (Bt, H, P); dt: (Bt, H), raw, before dt_bias and softplus; A: (H,)
        B, C: (Bt, G, N); head h uses group h // (H // G)
        state_slots: (Bt,); -1 marks a padding row
        D: (H,); dt_bias: (H,)
    Returns (Bt, H, P) in x.dtype:
        S = exp(dt' * A) * S + dt' * outer(x, B);  y = S @ C + D * x.
    Padding rows leave the pool untouched and output zeros. Rows must use distinct slots.
    """
    Bt, H, P = x.shape
    N = B.shape[-1]
    assert ssm_states.shape[1:] == (H, P, N)
    assert dt.shape == (Bt, H) and A.shape == (H,) and state_slots.shape == (Bt,)

    valid = state_slots >= 0
    # Padding rows are rare: index only when there are some.
    all_valid = bool(valid.all())
    if not all_valid:
        x, dt, B, C = x[valid], dt[valid], B[valid], C[valid]
    slots = state_slots if all_valid else state_slots[valid]
    slots = slots.long()
    num_valid = slots.shape[0]
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, H)
    xf = x.float()  # (b, H, P)
    B, C = expand_groups(B, H), expand_groups(C, H)  # (b, H, N)

    # Decode is bound by moving states (H * P * N floats per row), so update in place and,
    # when the rows' slots are one ascending run (the usual case: the runner sorts decode rows
    # by slot and slots are handed out lowest first), work on a view instead of gather/scatter.
    first = int(slots[0]) if num_valid else 0
    contiguous = bool(
        torch.equal(slots, torch.arange(first, first + num_valid, device=slots.device))
    )
    in_pool = contiguous and ssm_states.dtype == torch.float32
    states = (
        ssm_states[first : first + num_valid]
        if in_pool
        else ssm_states.index_select(0, slots).float()
    )
    states.mul_(torch.exp(dt * A.float())[:, :, None, None])
    states.addcmul_((dt[..., None] * xf)[..., None], B[:, :, None, :])  # += dt x B^T
    # NOTE: multiply-and-sum, not `states @ C`: MKL's batched mat-vec is 3x slower here.
    y = (states * C[:, :, None, :]).sum(dim=-1)  # (b, H, P)
    if D is not None:
        y = y + D.float()[:, None] * xf
    if not in_pool:
        ssm_states.index_copy_(0, slots, states.to(ssm_states.dtype))

    if all_valid:
        return y.to(x.dtype)
    out = x.new_zeros((Bt, H, P))
    out[valid] = y.to(x.dtype)
    return out
