"""Triton causal_conv1d / causal_conv1d_update against the references, on strided pool views."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import causal_conv1d_ref, causal_conv1d_update_ref
from hybridserve.kernels.triton import conv1d as triton_conv1d
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton

causal_conv1d = on_device(triton_conv1d.causal_conv1d)
causal_conv1d_update = on_device(triton_conv1d.causal_conv1d_update)

NUM_SLOTS, NUM_LAYERS, LAYER = 7, 2, 1
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),  # the pool keeps its own dtype
]


def make_inputs(T, C, W, dtype, state_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # x is a column slice of a wider projection, as xBC in Mamba2: rows are strided.
    x = torch.randn(T, C + 3, generator=gen).to(dtype)[:, 1 : C + 1]
    weight = torch.randn(C, W, generator=gen).to(dtype)
    bias = torch.randn(C, generator=gen).to(dtype)
    # The pool of every layer; a layer's conv states are the strided view pool[:, LAYER].
    pool = torch.randn(NUM_SLOTS, NUM_LAYERS, C, W - 1, generator=gen).to(state_dtype)
    return x, weight, bias, pool


def run_both(x, weight, bias, pool, **kwargs):
    """Run kernel and reference on separate copies of the pool: (result, ref result, ref pool)."""
    pool_ref = pool.clone()
    result = causal_conv1d(x, weight, bias, conv_states=pool[:, LAYER], **kwargs)
    expected = causal_conv1d_ref(x, weight, bias, conv_states=pool_ref[:, LAYER], **kwargs)
    return result, expected, pool_ref


@pytest.mark.parametrize(("dtype", "state_dtype"), DTYPES)
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_matches_reference(dtype, state_dtype, activation):
    C, W = 6, 4
    # Lengths 1 and 2 are shorter than W - 1 = 3 (their state keeps part of the history); 37
    # straddles the 32-token block boundary; 49 tokens in all, an odd count.
    lens = [1, 2, 37, 4, 5]
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    x, weight, bias, pool = make_inputs(sum(lens), C, W, dtype, state_dtype, seed=0)
    before = pool.clone()
    # Slot 0 is read by sequence 1 and written by sequence 0; slot 4 is read and rewritten by
    # sequence 4; sequence 2 starts from zeros; sequence 3's final state is dropped.
    initial = torch.tensor([2, 0, -1, 3, 4])
    final = torch.tensor([0, 5, 1, -1, 4])
    positions = torch.tensor([[2, 1], [2, 37], [0, 1], [3, 2], [1, 1], [2, 20], [4, 3], [1, 2]])

    result, expected, pool_ref = run_both(
        x,
        weight,
        bias,
        pool,
        cu_seqlens=cu_seqlens,
        initial_state_slots=initial,
        final_state_slots=final,
        activation=activation,
        state_positions=positions,
    )

    assert result.out.dtype == dtype and result.out.shape == x.shape
    torch.testing.assert_close(result.out, expected.out, rtol=TOL[dtype], atol=TOL[dtype])
    # States are copies of inputs: exact.
    assert result.position_states.dtype == state_dtype
    assert torch.equal(result.position_states, expected.position_states)
    assert torch.equal(pool, pool_ref)
    for slot in (2, 3, 6):  # read or untouched, never written
        assert torch.equal(pool[slot], before[slot])
    assert torch.equal(pool[:, 0], before[:, 0])


@pytest.mark.parametrize("W", [2, 3])
def test_varlen_other_widths_no_bias_no_positions(W):
    C = 5
    lens = [3, 1, 2]
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    x, weight, _, pool = make_inputs(sum(lens), C, W, torch.float32, torch.float32, seed=1)
    before = pool.clone()
    initial = torch.tensor([1, -1, 6], dtype=torch.int32)
    final = torch.tensor([3, 1, -1], dtype=torch.int32)

    result, expected, pool_ref = run_both(
        x,
        weight,
        None,
        pool,
        cu_seqlens=cu_seqlens,
        initial_state_slots=initial,
        final_state_slots=final,
    )

    assert result.position_states is None
    torch.testing.assert_close(result.out, expected.out, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_ref)
    assert not torch.equal(pool[[1, 3], LAYER], before[[1, 3], LAYER])


def test_several_channel_blocks():
    # C = 130 spans two 128-channel blocks; the second is masked.
    C, W = 130, 4
    lens = [2, 9]
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0)
    x, weight, bias, pool = make_inputs(sum(lens) + 2, C, W, torch.float32, torch.float32, seed=2)
    x, x_decode = x[:-2], x[-2:]

    result, expected, pool_ref = run_both(
        x,
        weight,
        bias,
        pool,
        cu_seqlens=cu_seqlens,
        initial_state_slots=torch.tensor([5, 2]),
        final_state_slots=torch.tensor([2, 0]),
        state_positions=torch.tensor([[1, 4], [0, 2]]),
    )
    torch.testing.assert_close(result.out, expected.out, rtol=1e-5, atol=1e-5)
    assert torch.equal(result.position_states, expected.position_states)
    assert torch.equal(pool, pool_ref)

    slots = torch.tensor([0, 2])
    out = causal_conv1d_update(
        x_decode, weight, bias, conv_states=pool[:, LAYER], state_slots=slots
    )
    out_ref = causal_conv1d_update_ref(
        x_decode, weight, bias, conv_states=pool_ref[:, LAYER], state_slots=slots
    )
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_ref)


@pytest.mark.parametrize(("dtype", "state_dtype"), DTYPES)
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_update_matches_reference_and_skips_padding(dtype, state_dtype, W, with_bias):
    C = 6
    slots = torch.tensor([3, -1, 0, 5, -1, 1])
    x, weight, bias, pool = make_inputs(slots.shape[0], C, W, dtype, state_dtype, seed=3)
    bias = bias if with_bias else None
    before = pool.clone()
    pool_ref = pool.clone()

    out = causal_conv1d_update(x, weight, bias, conv_states=pool[:, LAYER], state_slots=slots)
    expected = causal_conv1d_update_ref(
        x, weight, bias, conv_states=pool_ref[:, LAYER], state_slots=slots
    )

    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(out[slots < 0], torch.zeros(2, C, dtype=dtype))
    assert torch.equal(pool, pool_ref)
    assert not torch.equal(pool[[3, 0, 5, 1], LAYER], before[[3, 0, 5, 1], LAYER])
    for slot in (2, 4, 6):
        assert torch.equal(pool[slot], before[slot])
    assert torch.equal(pool[:, 0], before[:, 0])


def test_prefill_then_decode_equals_one_prefill():
    # 5 prompt tokens through the varlen kernel, then 3 decode steps, against 8 tokens at once.
    C, W = 4, 4
    x, weight, bias, pool = make_inputs(8, C, W, torch.float32, torch.float32, seed=4)
    full_pool = pool.clone()
    slot = torch.tensor([2])
    full = causal_conv1d(
        x,
        weight,
        bias,
        cu_seqlens=torch.tensor([0, 8]),
        conv_states=full_pool[:, LAYER],
        initial_state_slots=slot,
        final_state_slots=slot,
    )
    prefill = causal_conv1d(
        x[:5],
        weight,
        bias,
        cu_seqlens=torch.tensor([0, 5]),
        conv_states=pool[:, LAYER],
        initial_state_slots=slot,
        final_state_slots=slot,
    )
    decoded = [
        causal_conv1d_update(
            x[t : t + 1], weight, bias, conv_states=pool[:, LAYER], state_slots=slot
        )
        for t in range(5, 8)
    ]
    torch.testing.assert_close(torch.cat([prefill.out, *decoded]), full.out)
    assert torch.equal(pool, full_pool)


def test_empty_and_bad_activation():
    x, weight, bias, pool = make_inputs(0, 4, 4, torch.float32, torch.float32, seed=5)
    out = causal_conv1d_update(
        x, weight, bias, conv_states=pool[:, LAYER], state_slots=torch.zeros(0, dtype=torch.int64)
    )
    assert out.shape == (0, 4)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(
            x,
            weight,
            bias,
            cu_seqlens=torch.tensor([0]),
            conv_states=pool[:, LAYER],
            initial_state_slots=torch.zeros(0, dtype=torch.int64),
            final_state_slots=torch.zeros(0, dtype=torch.int64),
            activation="gelu",
        )
