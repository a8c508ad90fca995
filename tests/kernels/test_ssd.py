"""mamba_chunk_scan_ref against a sequential float64 recurrence written out token by token."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.kernels.reference import mamba_chunk_scan_ref

H, G, P, N = 6, 3, 4, 8
CHUNK = 8
# Output tolerance per input dtype; states are float32 math on exact inputs in both cases.
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
STATE_TOL = 1e-5


def scan_oracle(x, dt, A, B, C, state, *, D, dt_bias, dt_softplus=True, dt_limit=(0.0, math.inf)):
    """One sequence, one token at a time, in float64. Returns y: (L, H, P), states: (L, H, P, N)."""
    x, dt, B, C, state = (t.double() for t in (x, dt, B, C, state))
    dt = dt + dt_bias.double()
    if dt_softplus:
        dt = torch.log1p(torch.exp(dt))
    dt = dt.clamp(*dt_limit)
    group = torch.arange(H) // (H // G)  # group read by each head
    ys, states = [], []
    for t in range(x.shape[0]):
        Bt, Ct = B[t, group], C[t, group]  # (H, N)
        decay = torch.exp(dt[t] * A.double())
        state = decay[:, None, None] * state + (dt[t][:, None] * x[t])[:, :, None] * Bt[:, None, :]
        ys.append((state * Ct[:, None, :]).sum(-1) + D.double()[:, None] * x[t])
        states.append(state)
    return torch.stack(ys), torch.stack(states)


def make_inputs(lens, dtype, *, num_slots=8, positive_dt=False):
    T = sum(lens)
    raw_dt = torch.rand(T, H) * 0.5 if positive_dt else torch.randn(T, H)
    return dict(
        x=torch.randn(T, H, P).to(dtype),
        dt=raw_dt.to(dtype),
        A=-torch.exp(torch.rand(H)),
        B=torch.randn(T, G, N).to(dtype),
        C=torch.randn(T, G, N).to(dtype),
        D=torch.randn(H),
        dt_bias=torch.rand(H) * 0.1 if positive_dt else torch.randn(H) * 0.5,
        cu_seqlens=torch.tensor([0, *lens]).cumsum(0),
        ssm_states=torch.randn(num_slots, H, P, N),
    )


def tokens(inp, start, end):
    """The per-token inputs of packed tokens [start, end), with the per-head ones unchanged."""
    return {k: v[start:end] if k in ("x", "dt", "B", "C") else v for k, v in inp.items()}


def scan(inp, initial, final, **kwargs):
    """mamba_chunk_scan_ref on make_inputs() tensors, with D and dt_bias, chunk size CHUNK."""
    kwargs = {"chunk_size": CHUNK, "D": inp["D"], "dt_bias": inp["dt_bias"], **kwargs}
    return mamba_chunk_scan_ref(
        *(inp[k] for k in ("x", "dt", "A", "B", "C")),
        cu_seqlens=inp["cu_seqlens"],
        ssm_states=inp["ssm_states"],
        initial_state_slots=torch.tensor(initial),
        final_state_slots=torch.tensor(final),
        **kwargs,
    )


def run_oracle(inp, seq, initial_slot, **dt_kwargs):
    start, end = inp["cu_seqlens"][seq].item(), inp["cu_seqlens"][seq + 1].item()
    state = inp["ssm_states"][initial_slot] if initial_slot >= 0 else torch.zeros(H, P, N)
    seq_inp = tokens(inp, start, end)
    return scan_oracle(
        *(seq_inp[k] for k in ("x", "dt", "A", "B", "C")),
        state,
        D=inp["D"],
        dt_bias=inp["dt_bias"],
        **dt_kwargs,
    )


DT_CASES = {
    "softplus": {},
    "clamped": {"dt_limit": (0.2, 0.8)},
    "no_softplus": {"dt_softplus": False},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dt_case", list(DT_CASES))
def test_varlen_scan_matches_recurrence(dtype, dt_case):
    torch.manual_seed(0)
    dt_kwargs = DT_CASES[dt_case]
    # Lengths: shorter than, equal to and longer than the chunk, and a single token.
    lens = [13, 1, 5, 27, 16]
    inp = make_inputs(lens, dtype, positive_dt=dt_case == "no_softplus")
    # Slot 5 is read by sequence 2 and written by sequence 0, slot 3 read by 0 and written by 3:
    # both must read the pool as it was before the call.
    initial, final = [3, -1, 5, 0, -1], [5, 1, -1, 3, 6]
    positions = torch.tensor([[0, 1], [0, 8], [3, 17], [3, 9], [1, 1], [0, 13], [4, 16], [3, 27]])
    before = inp["ssm_states"].clone()

    result = scan(inp, initial, final, state_positions=positions, **dt_kwargs)

    assert result.out.dtype == dtype and result.out.shape == inp["x"].shape
    expected_pool = before.clone()
    oracle_states = []
    for s in range(len(lens)):
        y, states = run_oracle({**inp, "ssm_states": before}, s, initial[s], **dt_kwargs)
        start, end = inp["cu_seqlens"][s].item(), inp["cu_seqlens"][s + 1].item()
        tol = OUT_TOL[dtype]
        torch.testing.assert_close(result.out[start:end].double(), y, rtol=tol, atol=tol)
        if final[s] >= 0:
            expected_pool[final[s]] = states[-1].float()
        oracle_states.append(states)

    # Written slots hold the final states; slots 0, 2, 4, 7 are untouched (bit for bit).
    torch.testing.assert_close(inp["ssm_states"], expected_pool, rtol=STATE_TOL, atol=STATE_TOL)
    for slot in (0, 2, 4, 7):
        assert torch.equal(inp["ssm_states"][slot], before[slot])
    expected_positions = torch.stack([oracle_states[s][p - 1] for s, p in positions.tolist()])
    assert result.position_states.dtype == torch.float32
    torch.testing.assert_close(
        result.position_states.double(), expected_positions, rtol=STATE_TOL, atol=STATE_TOL
    )


def test_chunked_prefill_equals_one_call():
    torch.manual_seed(1)
    inp = make_inputs([29], torch.float32)
    split_pool = inp["ssm_states"].clone()
    once = scan(inp, [2], [4])

    # Split at 11 (not a chunk multiple): the first part leaves its state in slot 4, the second
    # part starts from slot 4 and overwrites it.
    split = {**inp, "ssm_states": split_pool}
    first = scan({**tokens(split, 0, 11), "cu_seqlens": torch.tensor([0, 11])}, [2], [4])
    second = scan({**tokens(split, 11, 29), "cu_seqlens": torch.tensor([0, 18])}, [4], [4])

    torch.testing.assert_close(torch.cat([first.out, second.out]), once.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_pool, inp["ssm_states"], rtol=1e-5, atol=1e-5)


def test_low_precision_state_pool():
    torch.manual_seed(2)
    inp = make_inputs([10, 3], torch.float32, num_slots=3)
    inp["ssm_states"] = pool = inp["ssm_states"].half()
    before = pool.clone()

    result = scan(inp, [0, -1], [2, 0], chunk_size=4, state_positions=torch.tensor([[0, 6]]))

    # The initial state is the fp16 pool entry; results are rounded to fp16 once, at the end.
    _, states0 = run_oracle({**inp, "ssm_states": before}, 0, 0)
    _, states1 = run_oracle(inp, 1, -1)
    assert result.position_states.dtype == torch.float16
    torch.testing.assert_close(result.position_states[0], states0[5].half(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pool[2], states0[-1].half(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pool[0], states1[-1].half(), rtol=1e-3, atol=1e-3)
    assert torch.equal(pool[1], before[1])


@pytest.mark.parametrize("bad", [[0, 0], [0, 4], [2, 1]])
def test_state_position_outside_sequence_is_rejected(bad):
    inp = make_inputs([3, 2], torch.float32)
    with pytest.raises(ValueError, match="state_positions row 0"):
        scan(inp, [-1, -1], [-1, -1], state_positions=torch.tensor([bad]))
