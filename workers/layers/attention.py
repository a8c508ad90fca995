"""Softmax attention over the paged KV cache (GQA, optional RoPE).

Under tensor parallelism each rank computes its share of the query heads. KV heads are split
the same way when there are at least as many as ranks; with fewer (down to one, MQA) each rank
holds the one KV head its query heads read, replicated over tp / kv_heads ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import (
    attention_decode_pooled,
    paged_attention_prefill,
    store_kv_pooled,
)
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_ranges,
)
from hybridserve.workers.layers.rope import RotaryEmbedding
from hybridserve.workers.models.config import AttentionSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, KVLayer


class Attention(nn.Module):
    def __init__(
        self,
        spec: AttentionSpec,
        hidden_size: int,
        max_positions: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.num_heads = parallel.split(spec.num_heads, "num_attention_heads")
        self.head_dim = spec.head_dim
        self.scale = spec.scale
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_rows = parallel.piece(kv_size, spec.num_kv_heads)
        self.num_kv_heads = kv_rows[1] // spec.head_dim
        common = {"dtype": dtype, "device": device}
        self.q_proj = ColumnParallelLinear(
            hidden_size, split_ranges([q_size], parallel), spec.bias, **common
        )
        self.k_proj = ColumnParallelLinear(hidden_size, [kv_rows], spec.bias, **common)
        self.v_proj = ColumnParallelLinear(hidden_size, [kv_rows], spec.bias, **common)
        self.o_proj = RowParallelLinear(
            q_size, hidden_size, spec.bias, parallel, name="o_proj", **common
        )
        self.rope = (
            RotaryEmbedding(spec.rope, max_positions, device) if spec.rope is not None else None
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVLayer) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(batch.positions, q, k)
        # Through (pool, layer): a step the compiled path traces writes the pool in place.
        store_kv_pooled(k, v, kv_cache.pool, kv_cache.layer, batch.slot_mapping)

        nd = batch.num_decode
        parts = []
        if nd:
            parts.append(
                attention_decode_pooled(
                    q[:nd],
                    kv_cache.pool,
                    kv_cache.layer,
                    block_tables=batch.block_tables[:nd],
                    seq_lens=batch.seq_lens[:nd],
                    scale=self.scale,
                )
            )
        if num_tokens > nd:
            parts.append(
                paged_attention_prefill(
                    q[nd:],
                    kv_cache.key,
                    kv_cache.value,
                    block_tables=batch.block_tables[nd:],
                    cu_seqlens_q=batch.prefill_cu_seqlens,
                    seq_lens=batch.seq_lens[nd:],
                    scale=self.scale,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
