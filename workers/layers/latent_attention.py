"""Multi-head latent attention (Kimi Linear's full-attention layers, after DeepSeek-V2) over a
KV cache that holds the latent.

    q      = q_proj(x)  or  q_b(norm(q_a(x)))          per head: q_nope | q_rope
    latent = kv_a(x) = c | k_rope,  c RMS-normed       shared by every head
    k_h    = W_uk[h] c | k_rope,    v_h = W_uv[h] c    (kv_b's rows of head h: k_nope | v)

The cache keeps each token's latent [c | k_rope] once: one "head" of its width in a pool of one
plane (models/config.py LatentKVSpec), and that is what prefill hands to decode. Attention runs
on the latent with the up-projections absorbed: per head, q_nope . W_uk[h] c = (W_uk[h]^T q_nope)
. c, so the query is [W_uk[h]^T q_nope | q_rope] and the keys are the latents themselves; the
values are the latents too (V is K), and W_uv[h] applies to the attended c afterwards. The
paged attention kernels serve it as multi-query attention of the latent's width.

Under tensor parallelism each rank holds 1/tp of the heads (their q rows, kv_b rows, o_proj
columns); the latent projection and its norm are replicated, and so is the cache (one head,
on every rank).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import store_kv_pooled
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.attention import paged_attention
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    mark_shard,
    new_param,
    split_ranges,
)
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.layers.rope import RotaryEmbedding
from hybridserve.workers.models.config import AttentionSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, KVLayer


class LatentAttention(nn.Module):
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
        latent = spec.latent
        assert latent is not None
        self.latent = latent
        self.num_heads = parallel.split(spec.num_heads, "num_attention_heads")
        self.scale = spec.scale
        self.qk_dim = latent.qk_nope_head_dim + latent.qk_rope_head_dim
        common = {"dtype": dtype, "device": device}
        q_rows = split_ranges([spec.num_heads * self.qk_dim], parallel)
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a: ReplicatedLinear | None = None
        if latent.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, q_rows, False, **common)
        else:
            self.q_a = ReplicatedLinear(hidden_size, latent.q_lora_rank, spec.bias, **common)
            self.q_norm = RMSNorm(latent.q_lora_rank, latent.norm_eps, dtype, device)
            self.q_b = ColumnParallelLinear(latent.q_lora_rank, q_rows, False, **common)
        self.kv_a = ReplicatedLinear(
            hidden_size, latent.kv_lora_rank + latent.qk_rope_head_dim, spec.bias, **common
        )
        self.kv_norm = RMSNorm(latent.kv_lora_rank, latent.norm_eps, dtype, device)
        # kv_b is only ever read as its per-head blocks W_uk | W_uv, never as a GEMM.
        per_head = latent.qk_nope_head_dim + latent.v_head_dim
        self.kv_b_weight = mark_shard(
            new_param(self.num_heads * per_head, latent.kv_lora_rank, **common),
            0,
            split_ranges([spec.num_heads * per_head], parallel),
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * latent.v_head_dim,
            hidden_size,
            spec.bias,
            parallel,
            name="o_proj",
            **common,
        )
        self.rope = (
            RotaryEmbedding(spec.rope, max_positions, device) if spec.rope is not None else None
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVLayer) -> torch.Tensor:
        latent, heads = self.latent, self.num_heads
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a is not None
            q = self.q_b(self.q_norm(self.q_a(hidden)))
        q_nope, q_rope = q.view(num_tokens, heads, self.qk_dim).split(
            [latent.qk_nope_head_dim, latent.qk_rope_head_dim], dim=-1
        )
        c, k_rope = self.kv_a(hidden).split([latent.kv_lora_rank, latent.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_norm(c), k_rope[:, None, :]
        if self.rope is not None:
            q_rope, k_rope = self.rope(batch.positions, q_rope, k_rope)
        w = self.kv_b_weight.view(heads, -1, latent.kv_lora_rank)
        w_uk, w_uv = w.split([latent.qk_nope_head_dim, latent.v_head_dim], dim=1)
        query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope], dim=-1)
        entry = torch.cat([c[:, None, :], k_rope], dim=-1)  # (T, 1, latent width)
        # Through (pool, layer): a step the compiled path traces writes the pool in place.
        store_kv_pooled(entry, entry, kv_cache.pool, kv_cache.layer, batch.slot_mapping)

        attended = paged_attention(query, batch, kv_cache, self.scale)  # (T, heads, width)
        out = torch.einsum("thc,hvc->thv", attended[..., : latent.kv_lora_rank], w_uv)
        return self.o_proj(out.reshape(num_tokens, heads * latent.v_head_dim))
