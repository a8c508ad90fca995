"""selective_state_update_ref against one float64 step, and against the chunked scan."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import mamba_chunk_scan_ref, selective_state_update_ref

H, G, P, N = 6, 3, 4, 8
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def step_oracle(state, x, dt, A, B, C, D, dt_bias):
    """One token of one row in float64: returns (new state (H, P, N), y (H, P))."""
    dt = torch.log1p(torch.exp(dt.double() + dt_bias.double()))
    group = torch.arange(H) // (H // G)
    B, C, x = B.double()[group], C.double()[group], x.double()
    state = torch.exp(dt * A.double())[:, None, None] * state.double()
    state = state + (dt[:, None] * x)[:, :, None] * B[:, None, :]
    return state, (state * C[:, None, :]).sum(-1) + D.double()[:, None] * x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_step_matches_oracle_and_skips_padding(dtype):
    torch.manual_seed(0)
    rows = 5
    slots = torch.tensor([4, -1, 0, 2, -1])
    x = torch.randn(rows, H, P).to(dtype)
    dt = torch.randn(rows, H).to(dtype)
    A, D, dt_bias = -torch.exp(torch.rand(H)), torch.randn(H), torch.randn(H) * 0.5
    B, C = torch.randn(rows, G, N).to(dtype), torch.randn(rows, G, N).to(dtype)
    pool = torch.randn(6, H, P, N)
    before = pool.clone()

    out = selective_state_update_ref(pool, x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias)

    assert out.dtype == dtype and out.shape == (rows, H, P)
    tol = OUT_TOL[dtype]
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros(H, P, dtype=dtype))
            continue
        state, y = step_oracle(before[slot], x[row], dt[row], A, B[row], C[row], D, dt_bias)
        torch.testing.assert_close(out[row].double(), y, rtol=tol, atol=tol)
        torch.testing.assert_close(pool[slot].double(), state, rtol=1e-5, atol=1e-5)
    for slot in (1, 3, 5):
        assert torch.equal(pool[slot], before[slot])


def test_scan_equals_successive_updates():
    torch.manual_seed(1)
    length, seqs = 11, 2
    x = torch.randn(seqs, length, H, P)
    dt = torch.randn(seqs, length, H)
    A, D, dt_bias = -torch.exp(torch.rand(H)), torch.randn(H), torch.randn(H) * 0.5
    B, C = torch.randn(seqs, length, G, N), torch.randn(seqs, length, G, N)
    pool = torch.randn(3, H, P, N)
    slots = torch.tensor([2, 0])

    pool_scan = pool.clone()
    scan = mamba_chunk_scan_ref(
        x.flatten(0, 1),
        dt.flatten(0, 1),
        A,
        B.flatten(0, 1),
        C.flatten(0, 1),
        chunk_size=4,
        cu_seqlens=torch.tensor([0, length, 2 * length]),
        ssm_states=pool_scan,
        initial_state_slots=slots,
        final_state_slots=slots,
        D=D,
        dt_bias=dt_bias,
    )

    pool_steps = pool.clone()
    outs = [
        selective_state_update_ref(
            pool_steps,
            x[:, t],
            dt[:, t],
            A,
            B[:, t],
            C[:, t],
            state_slots=slots,
            D=D,
            dt_bias=dt_bias,
        )
        for t in range(length)
    ]
    torch.testing.assert_close(
        torch.stack(outs, dim=1).flatten(0, 1), scan.out, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(pool_steps, pool_scan, rtol=1e-5, atol=1e-5)
