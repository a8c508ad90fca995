"""A residual sublayer of a hybrid model: `norm` then one op (mamba2, mamba1, gdn, short_conv,
attention, mlp, moe), or (post-norm) the op then `norm`, with its index in the KV pool or the
state pools; or an invocation of a shared block (layers/shared_block.py), which feeds the next
sublayer. The model's stack and the multi-token-prediction layers are made of these."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.attention import Attention
from hybridserve.workers.layers.gated_deltanet import GatedDeltaNet
from hybridserve.workers.layers.latent_attention import LatentAttention
from hybridserve.workers.layers.mamba1_mixer import Mamba1Mixer
from hybridserve.workers.layers.mamba_mixer import MambaMixer
from hybridserve.workers.layers.mlp import MLP
from hybridserve.workers.layers.moe import MoE
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.layers.shared_block import SharedBlock, SharedBlockInvocation
from hybridserve.workers.layers.short_conv import ShortConv
from hybridserve.workers.models.config import RECURRENT_KINDS, HybridModelConfig, LayerKind
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches


def norm_weight_dtype(config: HybridModelConfig, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if config.zero_centred_norms else dtype


class Sublayer(nn.Module):
    def __init__(
        self,
        config: HybridModelConfig,
        kind: LayerKind,
        cache_index: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        *,
        post_norm: bool = False,
        shared_block: SharedBlock | None = None,
    ) -> None:
        """`post_norm`: the norm applies to the op's output (x + norm(op(x)), OLMo's attention
        layers) rather than its input. `shared_block`: the block a shared_block sublayer
        invokes (its norms are the block's own)."""
        super().__init__()
        self.kind = kind
        self.post_norm = post_norm
        # Index of this layer inside the KV pool (attention) or the state pools (recurrent).
        self.cache_index = cache_index
        hidden = config.hidden_size
        norm_dtype = norm_weight_dtype(config, dtype)
        self.norm = (
            None if kind == "shared_block" else RMSNorm(hidden, config.norm_eps, norm_dtype, device)
        )
        self.op: nn.Module
        if kind == "shared_block":
            assert shared_block is not None
            self.op = SharedBlockInvocation(config, shared_block, dtype, device)
        elif kind == "mamba2":
            assert config.mamba2 is not None
            self.op = MambaMixer(config.mamba2, hidden, parallel, dtype, device)
        elif kind == "mamba1":
            assert config.mamba1 is not None
            self.op = Mamba1Mixer(config.mamba1, hidden, parallel, dtype, device)
        elif kind == "gdn":
            assert config.gdn is not None
            self.op = GatedDeltaNet(config.gdn, hidden, parallel, dtype, device)
        elif kind == "short_conv":
            assert config.short_conv is not None
            self.op = ShortConv(config.short_conv, hidden, parallel, dtype, device)
        elif kind == "attention" and config.attention and config.attention.latent:
            self.op = LatentAttention(
                config.attention,
                hidden,
                config.max_position_embeddings,
                parallel,
                dtype,
                device,
            )
        elif kind == "attention":
            assert config.attention is not None
            self.op = Attention(
                config.attention,
                hidden,
                config.max_position_embeddings,
                parallel,
                dtype,
                device,
                norm_dtype,
            )
        elif kind == "mlp":
            assert config.mlp is not None
            self.op = MLP(config.mlp, hidden, parallel, dtype, device)
        else:
            assert config.moe is not None
            self.op = MoE(config.moe, hidden, parallel, dtype, device)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, caches: StateCaches
    ) -> torch.Tensor:
        assert self.norm is not None, "a shared block is invoked with the embeddings"
        if self.post_norm:
            return self.norm(self._op(hidden, batch, caches))
        return self._op(self.norm(hidden), batch, caches)

    def _op(self, x: torch.Tensor, batch: ForwardBatch, caches: StateCaches) -> torch.Tensor:
        if self.kind in RECURRENT_KINDS:
            return self.op(x, batch, caches.recurrent_layer(self.cache_index))
        if self.kind == "attention":
            return self.op(x, batch, caches.kv_layer(self.cache_index))
        return self.op(x)
