"""One model definition for every supported hybrid architecture.

The checkpoint format differences live in the architecture adapters (`nemotron_h.py`,
`bamba.py`, `granite_moe_hybrid.py`, `qwen3_next.py`); this module only sees a
`HybridModelConfig`: a stack of residual sublayers `x + residual_multiplier * op(norm(x))`
(post-norm ones `op` then `norm`; a parallel one reads the input of the sublayer before it),
each op one of mamba2 / mamba1 / gdn / short_conv / attention / mlp / moe; or an invocation
of a shared block (Zamba2), whose output is added to the next sublayer's input instead.

Zero-centred norms (the checkpoint stores w, the norm scales by 1 + w) keep float32 weights:
the loader adds the 1 in float32, so the scale is exactly the one the model was trained with
whatever the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import can_pack, pack_weight, register_packed
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.linear import PackableLinear, packed_matmul
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.layers.shared_block import SharedBlock
from hybridserve.workers.layers.vocab import VocabParallelEmbedding, gather_logits, vocab_param
from hybridserve.workers.models.config import KV_KINDS, RECURRENT_KINDS, HybridModelConfig
from hybridserve.workers.models.mtp import MultiTokenPredictor
from hybridserve.workers.models.sublayer import Sublayer, norm_weight_dtype
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches


class HybridForCausalLM(nn.Module):
    def __init__(
        self,
        config: HybridModelConfig,
        parallel: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        mtp: bool = False,
    ) -> None:
        """`mtp`: build the checkpoint's multi-token-prediction layers too (models/mtp.py)."""
        super().__init__()
        self.config = config
        parallel = parallel or ParallelContext()
        self.parallel = parallel
        self.embed = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel, dtype, device
        )
        # Registered before the layers, so each shared parameter is named here once.
        self.shared_blocks = nn.ModuleList(
            SharedBlock(config, parallel, dtype, device)
            for _ in range(config.shared_block.num_blocks if config.shared_block else 0)
        )
        num_recurrent = num_attention = num_invocations = 0
        layers = []
        for i, kind in enumerate(config.layer_kinds):
            index, block = -1, None
            if kind in RECURRENT_KINDS:
                index, num_recurrent = num_recurrent, num_recurrent + 1
            elif kind in KV_KINDS:
                index, num_attention = num_attention, num_attention + 1
            if kind == "shared_block":
                block = self.shared_blocks[num_invocations % len(self.shared_blocks)]
                num_invocations += 1
            post_norm = i in config.post_norm_layer_ids
            layers.append(
                Sublayer(
                    config,
                    kind,
                    index,
                    parallel,
                    dtype,
                    device,
                    post_norm=post_norm,
                    shared_block=block,
                )
            )
        self.parallel_layers = frozenset(config.parallel_layer_ids)
        self.layers = nn.ModuleList(layers)
        self.final_norm = RMSNorm(
            config.hidden_size, config.norm_eps, norm_weight_dtype(config, dtype), device
        )
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_is_packed = False  # whether lm_head_packed exists (as PackableLinear)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else vocab_param(config.vocab_size, config.hidden_size, parallel, dtype, device)
        )
        self.mtp: MultiTokenPredictor | None = None
        if mtp:
            if not config.num_mtp_steps:
                raise ValueError("this checkpoint has no multi-token-prediction layers")
            self.mtp = MultiTokenPredictor(config, num_attention, parallel, dtype, device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head

    def forward(self, batch: ForwardBatch, caches: StateCaches) -> torch.Tensor:
        """Final-normed hidden states (T, hidden) for every token of the batch."""
        hidden = self.embed(batch.input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        residual_multiplier = self.config.residual_multiplier
        embeddings, layer_input, feed = hidden, hidden, None
        for i, layer in enumerate(self.layers):
            if layer.kind == "shared_block":  # its output joins the next sublayer's input
                kv = caches.kv_layer(layer.cache_index)
                feed = layer.op(hidden, embeddings, batch, kv)
                continue
            if i not in self.parallel_layers:  # a parallel sublayer reads its neighbour's input
                layer_input = hidden if feed is None else hidden + feed
                feed = None
            out = layer(layer_input, batch, caches)
            hidden = hidden + (out if residual_multiplier == 1.0 else out * residual_multiplier)
        return self.final_norm(hidden)

    def pack_for_cpu(self) -> None:
        """Give every linear layer (and the LM head) a CPU-packed weight for decode batches."""
        for module in self.modules():
            if isinstance(module, PackableLinear):
                module.pack_for_cpu()
        if can_pack(self.lm_head_weight):
            self.lm_head_packed = pack_weight(self.lm_head_weight)
            register_packed(self.lm_head_weight, self.lm_head_packed)
            self.lm_head_is_packed = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(R, hidden) -> float32 logits (R, vocab) on rank 0; None on the other ranks (every
        rank computes its vocabulary rows, rank 0 gathers them)."""
        local = packed_matmul(hidden, self.lm_head_weight, None, self.lm_head_is_packed)
        logits = gather_logits(local, self.parallel, self.config.vocab_size)
        if logits is None:
            return None
        logits = logits.float()
        divisor = self.config.logits_divisor
        return logits if divisor == 1.0 else logits / divisor
