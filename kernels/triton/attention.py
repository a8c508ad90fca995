"""Paged KV cache store and causal attention over it (GQA), in Triton.

Same signatures and semantics as `kernels.reference.attention`. Cache layout: key_cache and
value_cache are (num_blocks, Hkv, block_size, D), head-major inside a block, and may be strided
views (pool[:, layer, 0]) of a larger pool: kernels take every stride and never reshape them.
Token position p of sequence s lives at block block_tables[s, p // block_size], offset
p % block_size. Query head h reads kv head h // (H // Hkv).

    context of one sequence:  [ cached prefix ......... | new tokens (q_len) ]
    positions:                  0                         seq_len - q_len ... seq_len - 1
    the new token at position p attends to positions [0, p].

Both attention kernels run a flash-attention loop over tiles of BLOCK_N context positions
gathered through the block table (a tile may span several cache blocks, or part of one), with
an online softmax in float32 (running max `b_m`, running sum `b_l`, exp2 with log2(e) folded
into the scale). Table entries are only read for positions below the context length, so
garbage past a sequence's last block is never dereferenced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.attention import E4M3_MAX, store_kv_ref
from .fp8 import decode_e4m3
from .launch import dot_precision, strides


@triton.jit
def _store_kv_kernel(
    # pointers
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    # dims
    HKV: tl.constexpr,
    D: tl.constexpr,
    # strides
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_b,
    stride_kc_h,
    stride_kc_s,
    stride_kc_d,
    stride_vc_b,
    stride_vc_h,
    stride_vc_s,
    stride_vc_d,
    # meta
    BLOCK_SIZE: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    SATURATE: tl.constexpr,  # an FP8 cache's largest value (0: a float cache)
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_t).to(tl.int64)
    if slot < 0:
        return
    i_blk = slot // BLOCK_SIZE
    i_off = slot % BLOCK_SIZE

    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    mask = (o_h < HKV)[:, None] & (o_d < D)[None, :]

    p_k = key + i_t * stride_k_t + o_h[:, None] * stride_k_h + o_d[None, :] * stride_k_d
    p_v = value + i_t * stride_v_t + o_h[:, None] * stride_v_h + o_d[None, :] * stride_v_d
    b_k = tl.load(p_k, mask=mask)
    b_v = tl.load(p_v, mask=mask)

    p_kc = (
        key_cache
        + i_blk * stride_kc_b
        + i_off * stride_kc_s
        + o_h[:, None] * stride_kc_h
        + o_d[None, :] * stride_kc_d
    )
    p_vc = (
        value_cache
        + i_blk * stride_vc_b
        + i_off * stride_vc_s
        + o_h[:, None] * stride_vc_h
        + o_d[None, :] * stride_vc_d
    )
    if SATURATE > 0:  # into FP8: e4m3 has no infinity, so a value beyond its range is NaN
        b_k = tl.minimum(tl.maximum(b_k.to(tl.float32), -SATURATE), SATURATE)
        b_v = tl.minimum(tl.maximum(b_v.to(tl.float32), -SATURATE), SATURATE)
    tl.store(p_kc, b_k.to(p_kc.dtype.element_ty), mask=mask)
    tl.store(p_vc, b_v.to(p_vc.dtype.element_ty), mask=mask)


@triton.jit
def _load_paged_tile(
    cache,
    table_row,
    o_n,
    mask_n,
    o_d,
    mask_d,
    i_kvh,
    stride_c_b,
    stride_c_h,
    stride_c_s,
    stride_c_d,
    stride_bt_n,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """(BLOCK_N, BD) tile of positions o_n of one kv head; masked positions read nothing. An
    FP8 cache comes as its bytes (KV_FP8) and is decoded here."""
    # NOTE: the table is read only where mask_n holds, so garbage entries are never followed;
    # block ids go to int64 before the multiply because a whole pool can exceed 2**31 elements.
    b_blk = tl.load(table_row + (o_n // BLOCK_SIZE) * stride_bt_n, mask=mask_n, other=0)
    p_c = (
        cache
        + b_blk.to(tl.int64)[:, None] * stride_c_b
        + i_kvh * stride_c_h
        + (o_n % BLOCK_SIZE)[:, None] * stride_c_s
        + o_d[None, :] * stride_c_d
    )
    mask = mask_n[:, None] & mask_d[None, :]
    if KV_FP8:
        return decode_e4m3(tl.load(p_c, mask=mask, other=0))
    return tl.load(p_c, mask=mask, other=0.0)


@triton.jit
def _find_seq(cu_seqlens_q, num_seqs, i_prog, BLOCK_M: tl.constexpr):
    """Sequence owning program i_prog: sequence s owns ids from cu_seqlens_q[s] // BLOCK_M + s."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q + mid) // BLOCK_M + mid <= i_prog:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_prefill_kernel(
    # pointers
    q,
    o,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    # dims
    num_seqs,
    sm_scale,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    # strides
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_kc_b,
    stride_kc_h,
    stride_kc_s,
    stride_kc_d,
    stride_vc_b,
    stride_vc_h,
    stride_vc_s,
    stride_vc_d,
    stride_bt_s,
    stride_bt_n,
    # meta
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    i_prog, i_h = tl.program_id(0), tl.program_id(1)
    # The grid holds T // BLOCK_M + S query blocks, an upper bound on sum(cdiv(q_len, BLOCK_M));
    # programs past their sequence's last query block exit here.
    i_s = _find_seq(cu_seqlens_q, num_seqs, i_prog, BLOCK_M)
    bos = tl.load(cu_seqlens_q + i_s).to(tl.int64)
    q_len = tl.load(cu_seqlens_q + i_s + 1).to(tl.int32) - bos.to(tl.int32)
    q_start = (i_prog - (bos.to(tl.int32) // BLOCK_M + i_s)) * BLOCK_M
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens + i_s).to(tl.int32)
    i_kvh = i_h // GROUP
    table_row = block_tables + i_s.to(tl.int64) * stride_bt_s

    #   positions:  0 ....... ctx_start ... ctx_start + q_start ... kv_end - 1 ... seq_len - 1
    #                          [ new tokens ......[ this query block ]  ........ ]
    ctx_start = seq_len - q_len
    o_m = q_start + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BD)
    mask_m = o_m < q_len
    mask_d = o_d < D
    q_pos = ctx_start + o_m
    kv_end = ctx_start + tl.minimum(q_start + BLOCK_M, q_len)

    p_q = q + (bos + o_m)[:, None] * stride_q_t + i_h * stride_q_h + o_d[None, :] * stride_q_d
    b_q = tl.load(p_q, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = o_n < kv_end
        b_k = _load_paged_tile(
            key_cache, table_row, o_n, mask_n, o_d, mask_d, i_kvh,
            stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d, stride_bt_n, BLOCK_SIZE, KV_FP8,
        ).to(b_q.dtype)  # fmt: skip
        b_v = _load_paged_tile(
            value_cache, table_row, o_n, mask_n, o_d, mask_d, i_kvh,
            stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d, stride_bt_n, BLOCK_SIZE, KV_FP8,
        ).to(b_q.dtype)  # fmt: skip
        # [BLOCK_M, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        # NOTE: position 0 is in the first tile and every row may see it (padding rows have
        # q_pos >= kv_end and see all loaded keys), so no row is ever all -inf.
        mask_s = (o_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        b_s = tl.where(mask_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_alpha = tl.exp2(b_m - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None]
        b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    b_o = b_acc / b_l[:, None]
    p_o = o + (bos + o_m)[:, None] * stride_o_t + i_h * stride_o_h + o_d[None, :] * stride_o_d
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _paged_attention_decode_kernel(
    # pointers
    q,
    o,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    # dims
    sm_scale,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    # strides
    stride_q_b,
    stride_q_h,
    stride_q_d,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_kc_b,
    stride_kc_h,
    stride_kc_s,
    stride_kc_d,
    stride_vc_b,
    stride_vc_h,
    stride_vc_s,
    stride_vc_d,
    stride_bt_s,
    stride_bt_n,
    # meta
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per (row, kv head): the GROUP query heads sharing the kv head are the rows
    # of the score tile (padded to BLOCK_H >= 16 for tl.dot), so each key is loaded once.
    i_b, i_kvh = tl.program_id(0).to(tl.int64), tl.program_id(1)
    seq_len = tl.load(seq_lens + i_b).to(tl.int32)
    table_row = block_tables + i_b * stride_bt_s

    o_g = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BD)
    mask_g = o_g < GROUP
    mask_d = o_d < D
    mask_q = mask_g[:, None] & mask_d[None, :]
    o_h = i_kvh * GROUP + o_g

    p_q = q + i_b * stride_q_b + o_h[:, None] * stride_q_h + o_d[None, :] * stride_q_d
    b_q = tl.load(p_q, mask=mask_q, other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, BD], dtype=tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = o_n < seq_len
        b_k = _load_paged_tile(
            key_cache, table_row, o_n, mask_n, o_d, mask_d, i_kvh,
            stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d, stride_bt_n, BLOCK_SIZE, KV_FP8,
        ).to(b_q.dtype)  # fmt: skip
        b_v = _load_paged_tile(
            value_cache, table_row, o_n, mask_n, o_d, mask_d, i_kvh,
            stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d, stride_bt_n, BLOCK_SIZE, KV_FP8,
        ).to(b_q.dtype)  # fmt: skip
        # [BLOCK_H, BLOCK_N]; every tile holds at least one position below seq_len.
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale
        b_s = tl.where(mask_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_alpha = tl.exp2(b_m - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None]
        b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    # A row with seq_len 0 never enters the loop: b_acc and b_l are 0, the output is 0.
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = o + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_d[None, :] * stride_o_d
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_q)


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, D: int) -> None:
    assert key_cache.dim() == 4, f"key_cache {key_cache.shape} != (num_blocks, Hkv, bs, D)"
    assert key_cache.shape == value_cache.shape, f"{key_cache.shape} != {value_cache.shape}"
    assert key_cache.shape[3] == D, f"head dim {key_cache.shape[3]} != {D}"
    assert key_cache.dtype == value_cache.dtype


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels read it: an FP8 cache as its bytes (decode_e4m3)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _head_dim_block(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _store_kv_fwd(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    T, Hkv, D = key.shape
    assert value.shape == key.shape, f"value {value.shape} != key {key.shape}"
    _check_caches(key_cache, value_cache, D)
    assert key_cache.shape[1] == Hkv, f"cache kv heads {key_cache.shape[1]} != {Hkv}"
    assert slot_mapping.shape == (T,), f"slot_mapping {slot_mapping.shape} != ({T},)"
    if T == 0:
        return
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8 and not key_cache.is_cuda:
        # The interpreter has no float8 type to encode into: torch encodes (a copy either way).
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    _store_kv_kernel[(T,)](
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
        HKV=Hkv,
        D=D,
        **strides("k", key, "t", "h", "d"),
        **strides("v", value, "t", "h", "d"),
        **strides("kc", key_cache, "b", "h", "s", "d"),
        **strides("vc", value_cache, "b", "h", "s", "d"),
        BLOCK_SIZE=key_cache.shape[2],
        BH=triton.next_power_of_2(Hkv),
        BD=triton.next_power_of_2(D),
        SATURATE=E4M3_MAX if fp8 else 0.0,
    )


def _paged_attention_prefill_fwd(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    T, H, D = q.shape
    _check_caches(key_cache, value_cache, D)
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} kv heads"
    S = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (S + 1,), f"cu_seqlens_q {cu_seqlens_q.shape} != ({S + 1},)"
    assert block_tables.dim() == 2 and block_tables.shape[0] == S, f"{block_tables.shape}"
    o = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0 or S == 0:
        return o
    BD = _head_dim_block(D)
    BLOCK_M = block_m or 64
    BLOCK_N = block_n or (64 if BD <= 128 else 32)
    # NOTE: sum over sequences of cdiv(q_len, BLOCK_M) <= T // BLOCK_M + S, so this grid needs
    # no host sync on cu_seqlens_q; each program finds its sequence by binary search.
    grid = (T // BLOCK_M + S, H)
    _paged_attention_prefill_kernel[grid](
        q=q,
        o=o,
        key_cache=_kernel_view(key_cache),
        value_cache=_kernel_view(value_cache),
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        num_seqs=S,
        sm_scale=scale,
        D=D,
        GROUP=H // Hkv,
        **strides("q", q, "t", "h", "d"),
        **strides("o", o, "t", "h", "d"),
        **strides("kc", key_cache, "b", "h", "s", "d"),
        **strides("vc", value_cache, "b", "h", "s", "d"),
        **strides("bt", block_tables, "s", "n"),
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BD=BD,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
        num_stages=2,
    )
    return o


def _paged_attention_decode_fwd(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
) -> torch.Tensor:
    Bt, H, D = q.shape
    _check_caches(key_cache, value_cache, D)
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} kv heads"
    assert seq_lens.shape == (Bt,), f"seq_lens {seq_lens.shape} != ({Bt},)"
    assert block_tables.dim() == 2 and block_tables.shape[0] == Bt, f"{block_tables.shape}"
    o = torch.empty((Bt, H, D), dtype=q.dtype, device=q.device)
    if Bt == 0:
        return o
    BD = _head_dim_block(D)
    BLOCK_N = block_n or (64 if BD <= 128 else 32)
    _paged_attention_decode_kernel[(Bt, Hkv)](
        q=q,
        o=o,
        key_cache=_kernel_view(key_cache),
        value_cache=_kernel_view(value_cache),
        block_tables=block_tables,
        seq_lens=seq_lens,
        sm_scale=scale,
        D=D,
        GROUP=H // Hkv,
        **strides("q", q, "b", "h", "d"),
        **strides("o", o, "b", "h", "d"),
        **strides("kc", key_cache, "b", "h", "s", "d"),
        **strides("vc", value_cache, "b", "h", "s", "d"),
        **strides("bt", block_tables, "s", "n"),
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(H // Hkv)),
        BLOCK_N=BLOCK_N,
        BD=BD,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
        num_stages=2,
    )
    return o


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot.

    Shapes: key, value: (T, Hkv, D); key_cache, value_cache: (num_blocks, Hkv, block_size, D);
    slot_mapping: (T,) flat slot block_id * block_size + offset, -1 skips the token.
    """
    _store_kv_fwd(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' cached context.

    Shapes (T new tokens, S sequences, H query heads, Hkv kv heads, D head dim):
        q: (T, H, D)
        key_cache, value_cache: (num_blocks, Hkv, block_size, D), already holding the new tokens
        block_tables: (S, max_blocks); entries past a sequence's last block are ignored
        cu_seqlens_q: (S + 1,) cumulative new-token offsets
        seq_lens: (S,) context length including the new tokens
    Returns (T, H, D) in q.dtype; the softmax runs in float32.
    """
    return _paged_attention_prefill_fwd(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale
    )


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per row over its whole context, all rows at once.

    Shapes (Bt rows, H query heads, Hkv kv heads, D head dim):
        q: (Bt, H, D)
        key_cache, value_cache: (num_blocks, Hkv, block_size, D), already holding the new token
        block_tables: (Bt, max_blocks); entries past a row's last block are ignored
        seq_lens: (Bt,) context length including the new token; a row with 0 outputs zeros
    Returns (Bt, H, D) in q.dtype; the softmax runs in float32.
    """
    return _paged_attention_decode_fwd(q, key_cache, value_cache, block_tables, seq_lens, scale)
