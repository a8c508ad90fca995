"""causal_conv1d_ref / causal_conv1d_update_ref against F.conv1d over history ++ inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels.reference import causal_conv1d_ref, causal_conv1d_update_ref

C, W = 6, 4
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def conv_oracle(history, x, weight, bias, activation):
    """Left-padded causal conv in float64 over u = history ++ x; returns the last len(x) rows.

    history: (C, W - 1); x: (L, C) -> (L, C).
    """
    u = torch.cat([history.double().t(), x.double()])  # (W - 1 + L, C)
    full = F.conv1d(
        u.t()[None], weight.double()[:, None, :], bias.double(), padding=W - 1, groups=C
    )[0, :, : u.shape[0]].t()
    if activation == "silu":
        full = F.silu(full)
    return full[-x.shape[0] :]


def state_oracle(history, x, pos):
    """The last W - 1 inputs after `pos` tokens: (C, W - 1)."""
    return torch.cat([history.t(), x[:pos].to(history.dtype)])[-(W - 1) :].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_matches_full_conv(dtype, activation):
    torch.manual_seed(0)
    # Lengths 1 and 2 are shorter than W - 1 = 3: their new state keeps part of the history.
    lens = [1, 2, 7, 4]
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    x = torch.randn(sum(lens), C).to(dtype)
    weight, bias = torch.randn(C, W).to(dtype), torch.randn(C).to(dtype)
    pool = torch.randn(6, C, W - 1).to(dtype)
    before = pool.clone()
    # Slot 0 is read by sequence 1 and written by sequence 0.
    initial = torch.tensor([2, 0, -1, 3])
    final = torch.tensor([0, 4, 5, -1])
    positions = torch.tensor([[2, 1], [2, 7], [0, 1], [3, 2], [1, 1]])

    result = causal_conv1d_ref(
        x,
        weight,
        bias,
        cu_seqlens=cu_seqlens,
        conv_states=pool,
        initial_state_slots=initial,
        final_state_slots=final,
        activation=activation,
        state_positions=positions,
    )

    assert result.out.dtype == dtype and result.out.shape == x.shape
    expected_pool = before.clone()
    histories = []
    for s in range(len(lens)):
        start, end = cu_seqlens[s].item(), cu_seqlens[s + 1].item()
        slot = initial[s].item()
        history = before[slot] if slot >= 0 else torch.zeros(C, W - 1, dtype=dtype)
        histories.append(history)
        expected = conv_oracle(history, x[start:end], weight, bias, activation)
        tol = TOL[dtype]
        torch.testing.assert_close(result.out[start:end].double(), expected, rtol=tol, atol=tol)
        if final[s] >= 0:
            expected_pool[final[s]] = state_oracle(history, x[start:end], end - start)
    # States are copies of inputs: exact.
    assert torch.equal(pool, expected_pool)
    expected_positions = torch.stack(
        [
            state_oracle(histories[s], x[cu_seqlens[s] : cu_seqlens[s + 1]], pos)
            for s, pos in positions.tolist()
        ]
    )
    assert torch.equal(result.position_states, expected_positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_matches_varlen_and_skips_padding(dtype):
    torch.manual_seed(1)
    slots = torch.tensor([3, -1, 0, 5, -1, 1])
    rows = slots.shape[0]
    x = torch.randn(rows, C).to(dtype)
    weight, bias = torch.randn(C, W).to(dtype), torch.randn(C).to(dtype)
    pool = torch.randn(7, C, W - 1).to(dtype)
    before = pool.clone()

    out = causal_conv1d_update_ref(x, weight, bias, conv_states=pool, state_slots=slots)

    # The same rows as 1-token sequences through the varlen path.
    valid = slots >= 0
    pool_varlen = before.clone()
    varlen = causal_conv1d_ref(
        x[valid],
        weight,
        bias,
        cu_seqlens=torch.arange(int(valid.sum()) + 1),
        conv_states=pool_varlen,
        initial_state_slots=slots[valid],
        final_state_slots=slots[valid],
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out[valid], varlen.out, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(out[~valid], torch.zeros(2, C, dtype=dtype))
    assert torch.equal(pool, pool_varlen)
    for slot in (2, 4, 6):
        assert torch.equal(pool[slot], before[slot])
    # And against the oracle directly: shift left, append x.
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected = conv_oracle(before[slot], x[row : row + 1], weight, bias, "silu")
            tol = TOL[dtype]
            torch.testing.assert_close(out[row : row + 1].double(), expected, rtol=tol, atol=tol)
            assert torch.equal(pool[slot], state_oracle(before[slot], x[row : row + 1], 1))


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update_ref(
            torch.zeros(1, C),
            torch.zeros(C, W),
            None,
            conv_states=torch.zeros(1, C, W - 1),
            state_slots=torch.tensor([0]),
            activation="gelu",
        )
