"""The pool-addressed decode kernels (what the compiled decode step traces) against the eager
reference kernels on per-layer views: same outputs, same pool contents, other layers and slots
untouched."""

from __future__ import annotations

import torch

from hybridserve.kernels.reference import (
    causal_conv1d_update_ref,
    paged_attention_decode_ref,
    selective_state_update_ref,
    store_kv_ref,
)
from hybridserve.kernels.reference.pooled import (
    attention_decode_pooled,
    conv_update_pooled,
    state_update_pooled,
    store_kv_pooled,
)

LAYERS, LAYER = 3, 1
SLOTS = torch.tensor([5, 1, 3])  # not one ascending run: the eager kernels gather and scatter


def test_conv_update_matches_the_reference():
    torch.manual_seed(0)
    channels, width = 6, 4
    x = torch.randn(len(SLOTS), channels)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    pool = torch.randn(7, LAYERS, channels, width - 1)
    expected_pool = pool.clone()

    out = conv_update_pooled(
        x, weight, bias, conv_pool=pool, layer=LAYER, state_slots=SLOTS, activation="silu"
    )
    expected = causal_conv1d_update_ref(
        x,
        weight,
        bias,
        conv_states=expected_pool[:, LAYER],
        state_slots=SLOTS,
        activation="silu",
    )

    torch.testing.assert_close(out, expected)
    assert torch.equal(pool, expected_pool)


def test_state_update_matches_the_reference():
    torch.manual_seed(1)
    heads, groups, head_dim, state = 4, 2, 3, 5
    rows = len(SLOTS)
    x, dt = torch.randn(rows, heads, head_dim), torch.randn(rows, heads)
    A, D, dt_bias = -torch.exp(torch.rand(heads)), torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(rows, groups, state), torch.randn(rows, groups, state)
    pool = torch.randn(7, LAYERS, heads, head_dim, state)
    expected_pool = pool.clone()
    args = {"D": D, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": (0.0, 5.0)}

    out = state_update_pooled(pool, LAYER, x, dt, A, B, C, state_slots=SLOTS, **args)
    expected = selective_state_update_ref(
        expected_pool[:, LAYER], x, dt, A, B, C, state_slots=SLOTS, **args
    )

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(pool, expected_pool)
    untouched = [s for s in range(7) if s not in SLOTS.tolist()]
    assert torch.equal(pool[untouched], expected_pool[untouched])


def test_store_and_attention_decode_match_the_reference():
    """Three rows with 1, 6 and 9 tokens of context in blocks of 4; the table is wider than
    the longest row and holds garbage past each row's last block."""
    torch.manual_seed(2)
    kv_heads, heads, head_dim, block_size, num_blocks = 2, 4, 8, 4, 9
    pool = torch.randn(num_blocks, LAYERS, 2, kv_heads, block_size, head_dim)
    expected_pool = pool.clone()
    block_tables = torch.tensor([[2, 7, 7, 8], [4, 0, 8, 6], [1, 3, 5, 7]])
    seq_lens = torch.tensor([1, 6, 9])
    positions = seq_lens - 1
    slot_mapping = block_tables[torch.arange(3), positions // block_size] * block_size + (
        positions % block_size
    )
    q = torch.randn(3, heads, head_dim)
    k, v = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)

    store_kv_pooled(k, v, pool, LAYER, slot_mapping)
    out = attention_decode_pooled(
        q, pool, LAYER, block_tables=block_tables, seq_lens=seq_lens, scale=0.3
    )
    key, value = expected_pool[:, LAYER, 0], expected_pool[:, LAYER, 1]
    store_kv_ref(k, v, key, value, slot_mapping)
    expected = paged_attention_decode_ref(
        q, key, value, block_tables=block_tables, seq_lens=seq_lens, scale=0.3
    )

    assert torch.equal(pool, expected_pool)
    torch.testing.assert_close(out, expected)
