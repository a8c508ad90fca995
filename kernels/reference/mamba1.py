"""The Mamba1 selective scan (Jamba's SSM) over packed sequences and decode rows, in pure torch.

Per channel d and state column n, with Δ_t = softplus(dt_t + dt_bias) and A (D, N) negative:

    h_t[d, n] = exp(Δ_t[d] A[d, n]) h_{t-1}[d, n] + Δ_t[d] B_t[n] x_t[d]
    y_t[d]    = sum_n h_t[d, n] C_t[n] + D[d] x_t[d]

Unlike Mamba2 the decay differs per state column, so there is no chunked (quadratic) form: the
prompt scan runs the recurrence token by token, all sequences side by side (a sequence shorter
than the longest is padded with Δ = 0, which neither decays nor feeds its state). B and C are
shared by every channel. Everything is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import read_slots, write_slots


def _delta(dt: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    dt = dt.float()
    return F.softplus(dt if dt_bias is None else dt + dt_bias.float())


def mamba1_scan_ref(
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
    """Run the scan over S packed sequences, reading and writing states in a slot pool.

    Shapes (T tokens in total, D channels, N state size):
        x, dt: (T, D); dt raw, before dt_bias and softplus
        A: (D, N), negative
        B, C: (T, N)
        cu_seqlens: (S + 1,) cumulative token offsets; every sequence has at least one token
        ssm_states: (num_slots, D, N), written in place at `final_state_slots`
        initial_state_slots: (S,); -1 starts the sequence from a zero state
        final_state_slots: (S,); -1 skips writing the sequence's final state
        D, dt_bias: (D,)
    Returns y (T, D) in x.dtype. Every initial state is read before any final state is
    written, so a slot may be both read and written in one call.
    """
    T, channels = x.shape
    N = A.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    assert dt.shape == (T, channels) and A.shape == (channels, N)
    assert B.shape == (T, N) and C.shape == (T, N)
    assert ssm_states.shape[1:] == (channels, N)
    assert initial_state_slots.shape == (num_seqs,) and final_state_slots.shape == (num_seqs,)

    lengths = cu_seqlens.diff().long()
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lengths)
    lanes = torch.arange(T, device=x.device) - cu_seqlens[seq_ids].long()
    longest = int(lengths.max()) if num_seqs else 0

    def padded(t: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (S, longest, ...)
        out = t.new_zeros((num_seqs, longest, *t.shape[1:]))
        out[seq_ids, lanes] = t
        return out

    xf, delta = padded(x.float()), padded(_delta(dt, dt_bias))
    Bf, Cf = padded(B.float()), padded(C.float())
    Af = A.float()
    h = read_slots(ssm_states, initial_state_slots)  # (S, D, N)
    ys = []
    for t in range(longest):
        d = delta[:, t, :, None]  # (S, D, 1)
        h = torch.exp(d * Af) * h + d * Bf[:, t, None, :] * xf[:, t, :, None]
        ys.append((h * Cf[:, t, None, :]).sum(dim=-1))
    y = torch.stack(ys, dim=1)[seq_ids, lanes] if longest else x.new_zeros((0, channels))
    if D is not None:
        y = y + D.float() * x.float()
    write_slots(ssm_states, final_state_slots, h)
    return y.to(x.dtype)


def mamba1_step_ref(
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
    """One token per decode row. ssm_states: (num_slots, D, N), updated in place at
    `state_slots` (slot -1: a padding row, output 0, the pool untouched); x, dt: (Bt, D);
    A: (D, N); B, C: (Bt, N). Returns y (Bt, D) in x.dtype."""
    Bt = x.shape[0]
    assert ssm_states.shape[1:] == A.shape and dt.shape == x.shape
    assert B.shape == (Bt, A.shape[1]) and C.shape == B.shape and state_slots.shape == (Bt,)
    d = _delta(dt, dt_bias)[..., None]  # (Bt, D, 1)
    h = read_slots(ssm_states, state_slots)
    h = torch.exp(d * A.float()) * h + d * B.float()[:, None, :] * x.float()[..., None]
    y = (h * C.float()[:, None, :]).sum(dim=-1)
    if D is not None:
        y = y + D.float() * x.float()
    y = torch.where((state_slots >= 0)[:, None], y, 0.0)
    write_slots(ssm_states, state_slots, h)
    return y.to(x.dtype)
