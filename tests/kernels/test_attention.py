"""Paged attention references against dense causal attention in float64.

The caches are strided views (pool[:, layer, 0] and pool[:, layer, 1]) of one
(num_blocks, num_layers, 2, Hkv, block_size, D) tensor, so any `.view` on them would fail, and
block tables are random permutations padded with garbage past each sequence's last block.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import (
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kv_ref,
)

H, HKV, D = 4, 2, 8
BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, LAYER = 4, 24, 2, 1
GARBAGE = 12345  # table entries past a sequence's last block
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_pool(dtype):
    pool = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, HKV, BLOCK_SIZE, D).to(dtype)
    return pool, pool[:, LAYER, 0], pool[:, LAYER, 1]


def fill_paged(key_cache, value_cache, seq_lens, table_width):
    """Put random K/V for each sequence into randomly chosen blocks, one position at a time.

    Returns block_tables (S, table_width) and the dense contexts [(k, v) (len, Hkv, D) each].
    """
    block_ids = torch.randperm(NUM_BLOCKS).tolist()
    block_tables = torch.full((len(seq_lens), table_width), GARBAGE, dtype=torch.int32)
    contexts = []
    for s, seq_len in enumerate(seq_lens):
        for col in range(-(-seq_len // BLOCK_SIZE)):
            block_tables[s, col] = block_ids.pop()
        k = torch.randn(seq_len, HKV, D).to(key_cache.dtype)
        v = torch.randn(seq_len, HKV, D).to(key_cache.dtype)
        for pos in range(seq_len):
            block = block_tables[s, pos // BLOCK_SIZE]
            key_cache[block, :, pos % BLOCK_SIZE] = k[pos]
            value_cache[block, :, pos % BLOCK_SIZE] = v[pos]
        contexts.append((k, v))
    return block_tables, contexts


def dense_oracle(q, k, v, scale):
    """Causal GQA attention in float64; q: (q_len, H, D) are the last q_len of len(k) positions."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    q_len, seq_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_matches_dense(dtype):
    torch.manual_seed(0)
    _, key_cache, value_cache = make_pool(dtype)
    # A full prompt, a prompt after a 4-token cached prefix, and one token after 18 cached ones.
    seq_lens, q_lens = [13, 7, 19], [13, 3, 1]
    block_tables, contexts = fill_paged(key_cache, value_cache, seq_lens, table_width=8)
    cu_seqlens_q = torch.tensor([0, *q_lens]).cumsum(0)
    q = torch.randn(sum(q_lens), H, D).to(dtype)
    scale = D**-0.5

    out = paged_attention_prefill_ref(
        q,
        key_cache,
        value_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=torch.tensor(seq_lens),
        scale=scale,
    )

    assert out.dtype == dtype and out.shape == q.shape
    for s, (k, v) in enumerate(contexts):
        start, end = cu_seqlens_q[s].item(), cu_seqlens_q[s + 1].item()
        expected = dense_oracle(q[start:end], k, v, scale)
        torch.testing.assert_close(
            out[start:end].double(), expected, rtol=TOL[dtype], atol=TOL[dtype]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_dense(dtype):
    torch.manual_seed(1)
    _, key_cache, value_cache = make_pool(dtype)
    seq_lens = [1, 9, 16, 5, 4]
    block_tables, contexts = fill_paged(key_cache, value_cache, seq_lens, table_width=10)
    q = torch.randn(len(seq_lens), H, D).to(dtype)

    out = paged_attention_decode_ref(
        q,
        key_cache,
        value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens),
        scale=0.3,
    )

    assert out.dtype == dtype and out.shape == q.shape
    for row, (k, v) in enumerate(contexts):
        expected = dense_oracle(q[row : row + 1], k, v, 0.3)[0]
        torch.testing.assert_close(out[row].double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_decode_row_without_context_outputs_zeros():
    torch.manual_seed(2)
    _, key_cache, value_cache = make_pool(torch.float32)
    block_tables, (ctx,) = fill_paged(key_cache, value_cache, [6], table_width=3)
    block_tables = torch.cat([block_tables, torch.full_like(block_tables, GARBAGE)])
    q = torch.randn(2, H, D)

    out = paged_attention_decode_ref(
        q,
        key_cache,
        value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([6, 0]),
        scale=0.5,
    )

    torch.testing.assert_close(
        out[0].double(), dense_oracle(q[:1], *ctx, 0.5)[0], rtol=1e-5, atol=1e-6
    )
    assert torch.equal(out[1], torch.zeros(H, D))


def test_store_kv_writes_slots_and_skips_minus_one():
    torch.manual_seed(3)
    pool, key_cache, value_cache = make_pool(torch.float32)
    before = pool.clone()
    slot_mapping = torch.tensor([5, -1, 42, 0, -1, 93])
    key = torch.randn(6, HKV, D)
    value = torch.randn(6, HKV, D)

    store_kv_ref(key, value, key_cache, value_cache, slot_mapping)

    expected = before.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot // BLOCK_SIZE, LAYER, 0, :, slot % BLOCK_SIZE] = key[t]
            expected[slot // BLOCK_SIZE, LAYER, 1, :, slot % BLOCK_SIZE] = value[t]
    assert torch.equal(pool, expected)
