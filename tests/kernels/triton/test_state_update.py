"""Triton selective_state_update against selective_state_update_ref, on strided pool views."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import selective_state_update_ref
from hybridserve.kernels.triton import state_update as triton_state_update
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton

selective_state_update = on_device(triton_state_update.selective_state_update)

H, G = 4, 2  # two heads per group
NUM_SLOTS, NUM_LAYERS, LAYER = 6, 2, 1
OUT_TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
STATE_TOL = {torch.float32: 2e-5, torch.float16: 1e-3}

# (D and dt_bias given, dt_softplus, dt_limit)
DT_CASES = {
    "full": (True, True, (0.0, float("inf"))),
    "bare": (False, False, (0.0, float("inf"))),  # raw dt, negative values clamp to 0
    "limited": (True, True, (0.1, 0.6)),
}


def make_inputs(rows, P, N, dtype, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # x is a column slice of a wider projection, as in Mamba2: rows are strided.
    x = randn(rows, H * P + 5).to(dtype)[:, 2 : H * P + 2].unflatten(1, (H, P))
    dt = randn(rows, H).to(dtype)
    B, C = randn(rows, G, N).to(dtype), randn(rows, G, N).to(dtype)
    A = -torch.exp(torch.rand(H, generator=gen))
    D, dt_bias = randn(H), randn(H) * 0.5
    # The pool of every layer; a layer's states are the strided view pool[:, LAYER].
    pool = randn(NUM_SLOTS, NUM_LAYERS, H, P, N).to(state_dtype)
    return x, dt, A, B, C, D, dt_bias, pool


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("case", list(DT_CASES))
def test_matches_reference_and_skips_padding(dtype, state_dtype, case):
    with_optional, dt_softplus, dt_limit = DT_CASES[case]
    P, N = 6, 8  # P is not a power of two: the P-block is masked
    slots = torch.tensor([4, -1, 0, 2, -1])
    x, dt, A, B, C, D, dt_bias, pool = make_inputs(5, P, N, dtype, state_dtype, seed=0)
    optional = {"D": D, "dt_bias": dt_bias} if with_optional else {}
    before = pool.clone()
    pool_ref = pool.clone()

    out = selective_state_update(
        pool[:, LAYER],
        x,
        dt,
        A,
        B,
        C,
        state_slots=slots,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        **optional,
    )
    expected = selective_state_update_ref(
        pool_ref[:, LAYER],
        x,
        dt,
        A,
        B,
        C,
        state_slots=slots,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        **optional,
    )

    assert out.dtype == dtype and out.shape == (5, H, P)
    tol = OUT_TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert torch.equal(out[slots < 0], torch.zeros(2, H, P, dtype=dtype))
    tol = STATE_TOL[state_dtype]
    torch.testing.assert_close(pool, pool_ref, rtol=tol, atol=tol)
    # The states did move, and nothing else in the pool did: unused slots, the other layer.
    assert not torch.equal(pool[[4, 0, 2], LAYER], before[[4, 0, 2], LAYER])
    for slot in (1, 3, 5):
        assert torch.equal(pool[slot], before[slot])
    assert torch.equal(pool[:, 0], before[:, 0])


def test_several_p_blocks_and_masked_state_size():
    # N = 40 gives BLOCK_N = 64 (masked) and BLOCK_P = 8, so P = 12 spans two P-blocks.
    P, N = 12, 40
    slots = torch.tensor([5, 1, -1])
    x, dt, A, B, C, D, dt_bias, pool = make_inputs(3, P, N, torch.float32, torch.float32, seed=1)
    before = pool.clone()
    pool_ref = pool.clone()

    out = selective_state_update(
        pool[:, LAYER], x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias
    )
    expected = selective_state_update_ref(
        pool_ref[:, LAYER], x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias
    )

    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(pool[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    assert torch.equal(pool[:, 0], before[:, 0])


def test_successive_steps_match_reference():
    # Three decode steps on the same slots: the state written by one step is read by the next.
    P, N = 4, 8
    slots = torch.tensor([3, 0])
    pool = torch.randn(NUM_SLOTS, NUM_LAYERS, H, P, N, generator=torch.Generator().manual_seed(2))
    pool_ref = pool.clone()
    for step in range(3):
        x, dt, A, B, C, D, dt_bias, _ = make_inputs(2, P, N, torch.float32, torch.float32, step)
        out = selective_state_update(
            pool[:, LAYER], x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias
        )
        expected = selective_state_update_ref(
            pool_ref[:, LAYER], x, dt, A, B, C, state_slots=slots, D=D, dt_bias=dt_bias
        )
        torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=2e-5, atol=2e-5)


def test_empty_batch():
    x, dt, A, B, C, _, _, pool = make_inputs(0, 4, 8, torch.float32, torch.float32, seed=3)
    before = pool.clone()
    out = selective_state_update(
        pool[:, LAYER], x, dt, A, B, C, state_slots=torch.zeros(0, dtype=torch.int32)
    )
    assert out.shape == (0, H, 4)
    assert torch.equal(pool, before)
