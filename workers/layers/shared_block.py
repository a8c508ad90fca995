"""Zamba2's shared transformer blocks and their invocations.

A block's weights serve several depths of the model. Invocation j (block j % num_blocks) reads
the hidden state and the token embeddings:

    x = norm([hidden | embeddings])                  (an RMSNorm over twice the hidden size)
    a = attention(x)                                 q, k, v + this invocation's adapters
    m = mlp(norm'(a))                                gate | up + this invocation's adapter
    out = linear(m)                                  this invocation's own H x H weight

No residual inside: the model adds `out` to the next sublayer's input (models/hybrid.py).
Each invocation keeps its own KV cache layer (the same weights attend over different keys),
its adapters (layers/low_rank.py) and its output linear; only the `SharedBlock` is shared, one
module registered under every invocation that runs it.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.attention import Attention
from hybridserve.workers.layers.linear import ReplicatedLinear
from hybridserve.workers.layers.low_rank import LowRankAdapter, QKVAdapters
from hybridserve.workers.layers.mlp import MLP
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.runner.forward_batch import ForwardBatch, KVLayer


class SharedBlock(nn.Module):
    def __init__(
        self,
        config: HybridModelConfig,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        spec, attention = config.shared_block, config.attention
        assert spec is not None and attention is not None
        hidden, eps = config.hidden_size, config.norm_eps
        self.input_norm = RMSNorm(attention.input_size or hidden, eps, dtype, device)
        self.attention = Attention(
            attention, hidden, config.max_position_embeddings, parallel, dtype, device
        )
        self.ffn_norm = RMSNorm(hidden, eps, dtype, device)
        self.mlp = MLP(spec.mlp, hidden, parallel, dtype, device)


class SharedBlockInvocation(nn.Module):
    def __init__(
        self,
        config: HybridModelConfig,
        block: SharedBlock,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        spec = config.shared_block
        assert spec is not None
        self.block = block
        attention, rank = block.attention, spec.adapter_rank
        self.qkv_adapters: nn.ModuleList | None = None
        if spec.attention_adapters:
            self.qkv_adapters = nn.ModuleList(
                LowRankAdapter(attention.input_size, rank, rows, dtype, device)
                for rows in (attention.q_rows, attention.kv_rows, attention.kv_rows)
            )
        self.up_adapter = LowRankAdapter(config.hidden_size, rank, block.mlp.up_rows, dtype, device)
        self.linear = ReplicatedLinear(config.hidden_size, config.hidden_size, False, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVLayer,
    ) -> torch.Tensor:
        block = self.block
        x = block.input_norm(torch.cat([hidden, embeddings], dim=-1))
        adapters = QKVAdapters(*self.qkv_adapters) if self.qkv_adapters is not None else None
        attended = block.attention(x, batch, kv_cache, adapters)
        normed = block.ffn_norm(attended)
        return self.linear(block.mlp(normed, self.up_adapter))
