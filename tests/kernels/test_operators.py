"""The torch operators that read or write one layer of a state pool (kernels/operators.py),
each implementation of them (the C++ one registered for CPU tensors, and the reference that
calls the dispatched kernels on the layer's view), against the torch reference kernels on
per-layer views: same outputs, same pool contents, other layers and slots untouched. Pools of
fp32 go straight to the C kernels; bf16 ones take the C++ operators' copy-in, copy-out way."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import build_cpu_operators, operators
from hybridserve.kernels.reference import (
    causal_conv1d_update_ref,
    mamba1_step_ref,
    paged_attention_decode_ref,
    selective_state_update_ref,
    store_kv_ref,
)
from hybridserve.kernels.reference._common import prepare_dt

LAYERS, LAYER = 3, 1
SLOTS = torch.tensor([5, 1, 3])  # not one ascending run: the eager kernels gather and scatter
IMPLEMENTATIONS = ["cpp", "reference"]
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: {}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def ops(implementation: str):
    """The operators as the layers call them (torch picks the C++ one for CPU tensors once
    built), or their references directly."""
    if implementation == "reference":
        return operators
    if not build_cpu_operators():
        pytest.fail("the operators' C++ did not build (CI has a compiler)")
    return torch.ops.hybridserve


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_conv_update_matches_the_reference(implementation, dtype):
    torch.manual_seed(0)
    channels, width = 6, 4
    x = torch.randn(len(SLOTS), channels).to(dtype)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    pool = torch.randn(7, LAYERS, channels, width - 1).to(dtype)
    expected_pool = pool.clone()

    op = ops(implementation)
    run = op.conv_update_reference if implementation == "reference" else op.conv_update_
    out = run(pool, LAYER, x, weight, bias, SLOTS, "silu")
    expected = causal_conv1d_update_ref(
        x,
        weight,
        bias,
        conv_states=expected_pool[:, LAYER],
        state_slots=SLOTS,
        activation="silu",
    )

    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_state_update_matches_the_reference(implementation, dtype):
    torch.manual_seed(1)
    heads, groups, head_dim, state = 4, 2, 3, 5
    rows = len(SLOTS)
    x, dt = torch.randn(rows, heads, head_dim), torch.randn(rows, heads)
    A, D, dt_bias = -torch.exp(torch.rand(heads)), torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(rows, groups, state), torch.randn(rows, groups, state)
    pool = torch.randn(7, LAYERS, heads, head_dim, state).to(dtype)
    expected_pool = pool.clone()
    args = {"D": D, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": (0.0, 5.0)}

    op = ops(implementation)
    run = op.ssm_update_reference if implementation == "reference" else op.ssm_update_
    prepared = prepare_dt(dt, dt_bias, True, (0.0, 5.0))
    out = run(pool, LAYER, x, prepared, A, B, C, SLOTS, D)
    expected = selective_state_update_ref(
        expected_pool[:, LAYER], x, dt, A, B, C, state_slots=SLOTS, **args
    )

    torch.testing.assert_close(out, expected.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE[dtype])
    untouched = [s for s in range(7) if s not in SLOTS.tolist()]
    assert torch.equal(pool[untouched], expected_pool[untouched])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_store_and_attention_decode_match_the_reference(implementation, dtype):
    """Three rows with 1, 6 and 9 tokens of context in blocks of 4; the table is wider than
    the longest row and holds garbage past each row's last block. An FP8 pool (queries in
    fp32) stores keys beyond e4m3's range saturated, not NaN."""
    torch.manual_seed(2)
    kv_heads, heads, head_dim, block_size, num_blocks = 2, 4, 8, 4, 9
    pool = torch.randn(num_blocks, LAYERS, 2, kv_heads, block_size, head_dim).to(dtype)
    expected_pool = pool.clone()
    fp8 = dtype == torch.float8_e4m3fn
    block_tables = torch.tensor([[2, 7, 7, 8], [4, 0, 8, 6], [1, 3, 5, 7]])
    seq_lens = torch.tensor([1, 6, 9])
    positions = seq_lens - 1
    slot_mapping = block_tables[torch.arange(3), positions // block_size] * block_size + (
        positions % block_size
    )
    q = torch.randn(3, heads, head_dim).to(torch.float32 if fp8 else dtype)
    k, v = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    k[1, 0, :2] = torch.tensor([1000.0, -1000.0])

    op = ops(implementation)
    if implementation == "reference":
        op.store_kv_reference(pool, LAYER, k, v, slot_mapping)
        out = op.attention_decode_reference(q, pool, LAYER, block_tables, seq_lens, 0.3)
    else:
        op.store_kv_(pool, LAYER, k, v, slot_mapping)
        out = op.attention_decode(q, pool, LAYER, block_tables, seq_lens, 0.3)
    key, value = expected_pool[:, LAYER, 0], expected_pool[:, LAYER, 1]
    store_kv_ref(k, v, key, value, slot_mapping)
    expected = paged_attention_decode_ref(
        q, key, value, block_tables=block_tables, seq_lens=seq_lens, scale=0.3
    )

    assert torch.equal(pool.view(torch.uint8), expected_pool.view(torch.uint8))
    if fp8:
        stored = pool[block_tables[1, 1], LAYER, 0, 0, 1, :2].float()
        assert stored.tolist() == [448.0, -448.0]
    torch.testing.assert_close(out, expected.float(), **TOLERANCE.get(dtype, {}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mamba1_update_operator_matches_the_reference(dtype):
    """No C++ of its own: torch.ops reaches its reference, which runs the dispatched step (the
    C kernel on fp32 pools, the reference on bf16 ones) on the layer's view."""
    torch.manual_seed(0)
    channels, state = 6, 5
    x, dt = torch.randn(len(SLOTS), channels).to(dtype), torch.randn(len(SLOTS), channels)
    A = -torch.rand(channels, state)
    B, C = torch.randn(len(SLOTS), state), torch.randn(len(SLOTS), state)
    D, dt_bias = torch.randn(channels), torch.randn(channels)
    pool = torch.randn(7, LAYERS, channels, state).to(dtype)
    expected_pool = pool.clone()

    out = torch.ops.hybridserve.mamba1_update_(pool, LAYER, x, dt, A, B, C, SLOTS, D, dt_bias)
    expected = mamba1_step_ref(
        expected_pool[:, LAYER], x, dt, A, B, C, state_slots=SLOTS, D=D, dt_bias=dt_bias
    )

    torch.testing.assert_close(out.to(dtype), expected, **TOLERANCE[dtype])
    torch.testing.assert_close(pool, expected_pool, **TOLERANCE[dtype])
