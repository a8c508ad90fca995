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
    slots = state_slots[valid].long()
    dt = prepare_dt(dt[valid], dt_bias, dt_softplus, dt_limit)  # (b, H)
    xf = x[valid].float()  # (b, H, P)
    B, C = expand_groups(B[valid], H), expand_groups(C[valid], H)  # (b, H, N)

    decay = torch.exp(dt * A.float())[:, :, None, None]
    states = decay * ssm_states[slots].float() + (dt[..., None] * xf)[..., None] * B[:, :, None]
    y = torch.einsum("bhpn,bhn->bhp", states, C)
    if D is not None:
        y = y + D.float()[:, None] * xf
    ssm_states[slots] = states.to(ssm_states.dtype)

    out = x.new_zeros((Bt, H, P))
    out[valid] = y.to(x.dtype)
    return out
