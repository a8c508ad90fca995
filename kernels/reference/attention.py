"""Paged KV cache store and causal attention over it (GQA), in pure torch.

Cache layout: key_cache and value_cache are (num_blocks, Hkv, block_size, D), head-major inside
a block so that one kv head's run of positions is contiguous (attention reads it as one matrix,
and a tensor-parallel shard of a block is one slice). They may be strided views into a larger
pool, so they are only ever indexed, never reshaped in place. Token position p of sequence s
lives at block block_tables[s, p // block_size], offset p % block_size. Query head h reads kv
head h // (H // Hkv).

    context of one sequence:  [ cached prefix ......... | new tokens (q_len) ]
    positions:                  0                         seq_len - q_len ... seq_len - 1
    the new token at position p attends to positions [0, p].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def store_kv_ref(
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
    block_size = key_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = to_cache_dtype(key[valid], key_cache.dtype)
    value_cache[blocks, :, offsets] = to_cache_dtype(value[valid], value_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in a KV cache of `dtype`; into FP8, saturated at e4m3's largest finite value (a
    plain cast makes anything beyond it NaN, which has no e4m3 infinity to round to)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(dtype)


def _causal_lower_right(q_len: int, kv_len: int, device: torch.device) -> dict[str, Any]:
    """The bottom-right aligned causal mask as `scaled_dot_product_attention` arguments: query
    i sits at position kv_len - q_len + i. (What torch's `causal_lower_right` bias does on
    the CPU, without importing it: that module pulls in torch._dynamo, 1.6 s per process.)"""
    if q_len == kv_len:
        return {"is_causal": True}
    ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return {"attn_mask": torch.tril(ones, diagonal=kv_len - q_len)}


def paged_attention_prefill_ref(
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
    offsets = cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = offsets[s], offsets[s + 1]
        k, v = _gather_context(key_cache, value_cache, block_tables[s], seq_len)  # (Hkv, L, D)
        # NOTE: 4-D inputs: the fused CPU attention kernel only takes (batch, heads, len, dim).
        o = F.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1)[None],  # (1, H, q_len, D)
            k.float()[None],
            v.float()[None],
            **_causal_lower_right(end - start, seq_len, q.device),
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def paged_attention_decode_ref(
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
    Bt, H, D = q.shape
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max()) if Bt > 0 else 0
    if max_len == 0:
        return q.new_zeros((Bt, H, D))
    # NOTE: only the first ceil(max_len / block_size) columns are gathered, not the table's full
    # width; entries past each row's own last block may be garbage, so they read block 0 instead.
    num_cols = -(-max_len // block_size)
    num_keys = num_cols * block_size
    cols = torch.arange(num_cols, device=q.device)
    row_blocks = -(-seq_lens // block_size)
    blocks = torch.where(cols < row_blocks[:, None], block_tables[:, :num_cols], 0).long()
    keep = torch.arange(num_keys, device=q.device) < seq_lens[:, None]  # (Bt, num_keys)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # NOTE: index_select, not cache[blocks]: several times faster for whole-block rows.
        rows = cache.index_select(0, blocks.flatten()).view(Bt, num_cols, Hkv, block_size, D)
        return rows.transpose(1, 2).reshape(Bt, Hkv, num_keys, D).float()

    # The query heads sharing a kv head act as that head's "query positions" (no mask among
    # them), so one plain attention call covers GQA without repeating keys.
    out = F.scaled_dot_product_attention(
        q.float().view(Bt, Hkv, H // Hkv, D),
        gather(key_cache),
        gather(value_cache),
        attn_mask=keep[:, None, None, :],
        scale=scale,
    ).reshape(Bt, H, D)
    out = out.nan_to_num(0.0)  # an empty row (seq_len 0) has nothing to attend to
    return out.reshape(Bt, H, D).to(q.dtype)


def _gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, seq_len) of one sequence: two (Hkv, seq_len, D)."""
    block_size = key_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = key_cache.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :seq_len]
    v = value_cache.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :seq_len]
    return k, v
