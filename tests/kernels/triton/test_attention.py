"""Triton paged attention and store_kv against the torch references.

The caches are strided views (pool[:, layer, 0] and pool[:, layer, 1]) of one
(num_blocks, num_layers, 2, Hkv, block_size, D) tensor. Block tables are random permutations;
entries past each sequence's last block point at a poison block full of NaN, so a kernel that
follows them (instead of stopping at the context length) produces NaN. Queries are strided
slices of a wider tensor, as they are when sliced out of a fused QKV projection.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import (
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kv_ref,
)
from hybridserve.kernels.triton import attention as triton_attention
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton

_paged_attention_decode_fwd = on_device(triton_attention._paged_attention_decode_fwd)
_paged_attention_prefill_fwd = on_device(triton_attention._paged_attention_prefill_fwd)
paged_attention_decode = on_device(triton_attention.paged_attention_decode)
paged_attention_prefill = on_device(triton_attention.paged_attention_prefill)
store_kv = on_device(triton_attention.store_kv)

D, NUM_BLOCKS, NUM_LAYERS, LAYER = 8, 24, 2, 1
POISON = NUM_BLOCKS - 1  # every table entry past a sequence's last block points here
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
HEADS = pytest.mark.parametrize("H,Hkv", [(4, 2), (2, 2)], ids=["gqa", "mha"])


def make_pool(Hkv, block_size, dtype):
    pool = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, Hkv, block_size, D).to(dtype)
    pool[POISON] = float("nan")
    return pool, pool[:, LAYER, 0], pool[:, LAYER, 1]


def make_tables(seq_lens, block_size, table_width):
    """Random distinct blocks (never POISON) for each sequence, POISON past its last block."""
    block_ids = torch.randperm(POISON).tolist()
    block_tables = torch.full((len(seq_lens), table_width), POISON, dtype=torch.int32)
    for s, seq_len in enumerate(seq_lens):
        for col in range(-(-seq_len // block_size)):
            block_tables[s, col] = block_ids.pop()
    return block_tables


def make_q(T, H, dtype):
    """(T, H, D) query that is a strided slice of a wider (T, 3 * H, D) tensor."""
    return torch.randn(T, 3 * H, D).to(dtype)[:, H : 2 * H]


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


@DTYPES
@pytest.mark.parametrize("block_size", [4, 16], ids=["bs4", "bs16"])
def test_store_kv_matches_reference(dtype, block_size):
    torch.manual_seed(0)
    Hkv, T = 2, 7
    pool, key_cache, value_cache = make_pool(Hkv, block_size, dtype)
    expected_pool = pool.clone()
    num_slots = NUM_BLOCKS * block_size
    slot_mapping = torch.tensor([5, -1, num_slots - 1, 0, -1, block_size + 3, 2 * block_size])
    # key, value: (T, Hkv, D) strided slices of one fused buffer, in float32 for a cast on store.
    kv = torch.randn(T, 2, Hkv, D)
    key, value = kv[:, 0], kv[:, 1]

    store_kv(key, value, key_cache, value_cache, slot_mapping)
    store_kv_ref(key, value, expected_pool[:, LAYER, 0], expected_pool[:, LAYER, 1], slot_mapping)

    # The whole pool: written slots match, everything else (other layer, -1 tokens) untouched.
    assert torch.equal(pool.isnan(), expected_pool.isnan())
    assert torch.equal(pool.nan_to_num(), expected_pool.nan_to_num())


def test_store_kv_with_only_skipped_slots_changes_nothing():
    torch.manual_seed(1)
    pool, key_cache, value_cache = make_pool(2, 4, torch.float32)
    before = pool.clone()
    key = torch.randn(3, 2, D)

    store_kv(key, key, key_cache, value_cache, torch.full((3,), -1, dtype=torch.int32))

    assert torch.equal(pool.nan_to_num(), before.nan_to_num())


# Sequences: a full prompt, prompts after cached prefixes (one not block-aligned), one new token
# after a long prefix, and a long prompt that spans several query blocks of 16.
PREFILL_SEQ_LENS, PREFILL_Q_LENS = [13, 7, 19, 6, 37], [13, 3, 1, 5, 34]


def run_prefill(fn, q, key_cache, value_cache, block_tables, seq_lens, q_lens, scale):
    return fn(
        q,
        key_cache,
        value_cache,
        block_tables=block_tables,
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0),
        seq_lens=torch.tensor(seq_lens),
        scale=scale,
    )


@DTYPES
@pytest.mark.parametrize("block_size", [4, 16], ids=["bs4", "bs16"])
@HEADS
@pytest.mark.parametrize("tiles", [None, 16], ids=["default_tiles", "tiles16"])
def test_prefill_matches_reference(dtype, block_size, H, Hkv, tiles):
    torch.manual_seed(2)
    _, key_cache, value_cache = make_pool(Hkv, block_size, dtype)
    block_tables = make_tables(PREFILL_SEQ_LENS, block_size, table_width=12)
    q = make_q(sum(PREFILL_Q_LENS), H, dtype)
    args = (q, key_cache, value_cache, block_tables, PREFILL_SEQ_LENS, PREFILL_Q_LENS, D**-0.5)

    if tiles is None:
        out = run_prefill(paged_attention_prefill, *args)
    else:

        def small_tiles(q, kc, vc, *, block_tables, cu_seqlens_q, seq_lens, scale):
            return _paged_attention_prefill_fwd(
                q, kc, vc, block_tables, cu_seqlens_q, seq_lens, scale, block_m=tiles, block_n=tiles
            )

        out = run_prefill(small_tiles, *args)
    expected = run_prefill(paged_attention_prefill_ref, *args)

    assert not out.isnan().any()
    assert_close(out, expected, dtype)


def test_prefill_with_more_sequences_than_query_blocks():
    """Many one-token sequences: the grid bound T // BLOCK_M + S is all sequences here."""
    torch.manual_seed(3)
    seq_lens, q_lens = [1, 5, 2, 9, 1, 4], [1, 1, 1, 1, 1, 1]
    _, key_cache, value_cache = make_pool(2, 4, torch.float32)
    block_tables = make_tables(seq_lens, 4, table_width=4)
    q = make_q(len(q_lens), 4, torch.float32)
    args = (q, key_cache, value_cache, block_tables, seq_lens, q_lens, 0.4)

    out = run_prefill(paged_attention_prefill, *args)

    assert_close(out, run_prefill(paged_attention_prefill_ref, *args), torch.float32)


# Rows of different lengths: a single token, a partial block, exact multiples of 16, and one
# longer than two tiles of 16.
DECODE_SEQ_LENS = [1, 9, 16, 5, 4, 37]


def run_decode(fn, q, key_cache, value_cache, block_tables, seq_lens, scale):
    return fn(
        q,
        key_cache,
        value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens),
        scale=scale,
    )


@DTYPES
@pytest.mark.parametrize("block_size", [4, 16], ids=["bs4", "bs16"])
@HEADS
@pytest.mark.parametrize("tiles", [None, 16], ids=["default_tiles", "tiles16"])
def test_decode_matches_reference(dtype, block_size, H, Hkv, tiles):
    torch.manual_seed(4)
    _, key_cache, value_cache = make_pool(Hkv, block_size, dtype)
    block_tables = make_tables(DECODE_SEQ_LENS, block_size, table_width=12)
    q = make_q(len(DECODE_SEQ_LENS), H, dtype)
    args = (q, key_cache, value_cache, block_tables, DECODE_SEQ_LENS, 0.3)

    if tiles is None:
        out = run_decode(paged_attention_decode, *args)
    else:

        def small_tiles(q, kc, vc, *, block_tables, seq_lens, scale):
            return _paged_attention_decode_fwd(
                q, kc, vc, block_tables, seq_lens, scale, block_n=tiles
            )

        out = run_decode(small_tiles, *args)
    expected = run_decode(paged_attention_decode_ref, *args)

    assert not out.isnan().any()
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_an_fp8_cache_is_read_as_the_reference_reads_it(kernel):
    """e4m3 caches (read as bytes and decoded in the kernel) against the reference on the same
    caches; NaN bytes (the poison block) decode to NaN, so a tile that followed a stale table
    entry would still show."""
    torch.manual_seed(6)
    H, Hkv, block_size = 4, 2, 4
    _, key_cache, value_cache = make_pool(Hkv, block_size, torch.float8_e4m3fn)
    assert key_cache[POISON].float().isnan().all()
    if kernel == "prefill":
        block_tables = make_tables(PREFILL_SEQ_LENS, block_size, table_width=12)
        q = make_q(sum(PREFILL_Q_LENS), H, torch.float32)
        args = (q, key_cache, value_cache, block_tables, PREFILL_SEQ_LENS, PREFILL_Q_LENS, 0.4)
        out, expected = (run_prefill(f, *args) for f in (paged_attention_prefill,
                                                         paged_attention_prefill_ref))  # fmt: skip
    else:
        block_tables = make_tables(DECODE_SEQ_LENS, block_size, table_width=12)
        q = make_q(len(DECODE_SEQ_LENS), H, torch.float32)
        args = (q, key_cache, value_cache, block_tables, DECODE_SEQ_LENS, 0.3)
        out, expected = (run_decode(f, *args) for f in (paged_attention_decode,
                                                        paged_attention_decode_ref))  # fmt: skip
    assert not out.isnan().any()
    assert_close(out, expected, torch.float32)


def test_store_kv_into_an_fp8_cache_saturates():
    _, key_cache, value_cache = make_pool(2, 4, torch.float8_e4m3fn)
    key = torch.full((2, 2, D), 1000.0)
    store_kv(key, -key, key_cache, value_cache, torch.tensor([0, 5]))
    assert key_cache[0, :, 0].float().eq(448.0).all()
    assert value_cache[1, :, 1].float().eq(-448.0).all()


def test_decode_row_without_context_outputs_zeros():
    torch.manual_seed(5)
    _, key_cache, value_cache = make_pool(2, 4, torch.float16)
    seq_lens = [6, 0, 3]
    block_tables = make_tables(seq_lens, 4, table_width=3)
    q = make_q(3, 4, torch.float16)
    args = (q, key_cache, value_cache, block_tables, seq_lens, 0.5)

    out = run_decode(paged_attention_decode, *args)

    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, run_decode(paged_attention_decode_ref, *args), torch.float16)
