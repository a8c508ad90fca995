"""Softmax attention over the paged KV cache (GQA, optional RoPE, q/k norms, output gate).

Gated attention (Qwen3-Next, Qwen3.5) has q_proj give each head its queries followed by as many
gate logits, (heads, 2 * head_dim) rows; the attention output is multiplied by sigmoid(gate)
before o_proj. q/k RMSNorms apply before RoPE: per head (Qwen), or over all heads' projection
at once (OLMo; under tensor parallelism its sum of squares is summed over the ranks).

An FP8 KV cache holds k / k_scale and v / v_scale (per-layer scales from the checkpoint's
kv_cache_scheme, else 1.0); the scales come back exactly without touching the kernels: the
softmax scale takes k_scale and the output v_scale.

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
from hybridserve.workers.layers.low_rank import QKVAdapters
from hybridserve.workers.layers.norm import RMSNorm, SplitRMSNorm
from hybridserve.workers.layers.rope import RotaryEmbedding
from hybridserve.workers.models.config import AttentionSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, KVLayer


def paged_attention(
    q: torch.Tensor, batch: ForwardBatch, kv_cache: KVLayer, scale: float
) -> torch.Tensor:
    """q (T, H, D) over the layer's paged cache (its keys stored already): the batch's decode
    rows, then its prefill sequences. Returns (T, H, D)."""
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
                scale=scale,
            )
        )
    if q.shape[0] > nd:
        parts.append(
            paged_attention_prefill(
                q[nd:],
                kv_cache.key,
                kv_cache.value,
                block_tables=batch.block_tables[nd:],
                cu_seqlens_q=batch.prefill_cu_seqlens,
                seq_lens=batch.seq_lens[nd:],
                scale=scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Attention(nn.Module):
    # What an FP8 KV cache holds of k and v: k / k_scale, v / v_scale (the loader sets them).
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(
        self,
        spec: AttentionSpec,
        hidden_size: int,
        max_positions: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        norm_dtype: torch.dtype | None = None,
    ) -> None:
        """`norm_dtype`: the q/k norms' weight dtype (float32 for zero-centred norms, whose
        1 + w the loader computes in float32); default `dtype`."""
        super().__init__()
        self.num_heads = parallel.split(spec.num_heads, "num_attention_heads")
        self.head_dim = spec.head_dim
        self.scale = spec.scale
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_rows = parallel.piece(kv_size, spec.num_kv_heads)
        self.num_kv_heads = kv_rows[1] // spec.head_dim
        common = {"dtype": dtype, "device": device}
        self.output_gate = spec.output_gate
        q_rows = 2 * q_size if spec.output_gate else q_size  # whole heads per rank either way
        # q, k and v read the hidden state, or what the spec names instead (`input_size`).
        self.input_size = in_size = spec.input_size or hidden_size
        self.q_rows = split_ranges([q_rows], parallel)
        self.kv_rows = [kv_rows]
        self.q_proj = ColumnParallelLinear(in_size, self.q_rows, spec.bias, **common)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        eps = spec.qk_norm_eps
        if eps is not None and spec.qk_norm_scope == "head":
            self.q_norm = RMSNorm(spec.head_dim, eps, norm_dtype or dtype, device)
            self.k_norm = RMSNorm(spec.head_dim, eps, norm_dtype or dtype, device)
        elif eps is not None:
            q_local = self.num_heads * spec.head_dim
            kv_replicas = max(1, parallel.tp_size // spec.num_kv_heads)
            norm = (eps, parallel, norm_dtype or dtype, device)
            self.q_norm = SplitRMSNorm(q_size, (parallel.tp_rank * q_local, q_local), 1, *norm)
            self.k_norm = SplitRMSNorm(kv_size, kv_rows, kv_replicas, *norm)
        self.k_proj = ColumnParallelLinear(in_size, self.kv_rows, spec.bias, **common)
        self.v_proj = ColumnParallelLinear(in_size, self.kv_rows, spec.bias, **common)
        self.o_proj = RowParallelLinear(
            q_size, hidden_size, spec.bias, parallel, name="o_proj", **common
        )
        self.rope = (
            RotaryEmbedding(spec.rope, max_positions, device) if spec.rope is not None else None
        )

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVLayer,
        adapters: QKVAdapters | None = None,
    ) -> torch.Tensor:
        """`adapters`: low-rank terms added to q, k and v (a Zamba2 invocation's)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if adapters is not None:
            q, k, v = q + adapters.q(hidden), k + adapters.k(hidden), v + adapters.v(hidden)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, -1).chunk(2, dim=-1)
        else:
            q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(self.q_norm, SplitRMSNorm) and isinstance(self.k_norm, SplitRMSNorm):
            q = self.q_norm(q.reshape(num_tokens, -1)).view_as(q)
            k = self.k_norm(k.reshape(num_tokens, -1)).view_as(k)
        elif self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(batch.positions, q, k)
        scale, v_scale = self.scale, 1.0
        if kv_cache.pool.dtype == torch.float8_e4m3fn and (self.k_scale, self.v_scale) != (1, 1):
            k, v = k / self.k_scale, v / self.v_scale
            scale, v_scale = scale * self.k_scale, self.v_scale
        # Through (pool, layer): a step the compiled path traces writes the pool in place.
        store_kv_pooled(k, v, kv_cache.pool, kv_cache.layer, batch.slot_mapping)

        out = paged_attention(q, batch, kv_cache, scale)
        if v_scale != 1.0:
            out = out * v_scale
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
