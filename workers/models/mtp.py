"""Multi-token prediction (MTP): the extra layers NemotronH, Qwen3-Next and Qwen3.5 ship to
guess the token after next.

One prediction step at position p takes the target's final-normed hidden state h_p and the
embedding of the token after it, x_{p+1}, and predicts x_{p+2}:

    e = enorm(embed(x_{p+1}))        h = hnorm(h_p)
    y = fc([e | h])                  (2 hidden -> hidden)
    y = y + op(norm(y))              for each sublayer of the step (attention, then an MLP
                                     or MoE), attention over the step's own KV at positions
                                     <= p, at position p
    y = final_norm(y)                -> the target's LM head -> logits of x_{p+2}

Chaining steps proposes several tokens: step s + 1 takes y (at p) and the token step s
predicted, at position p + 1. A checkpoint has layers for `num_mtp_steps` steps (Qwen3-Next
and Qwen3.5 share the fusion and final norms between them; NemotronH has one step); step s
uses layers s mod that. The attention layers' KV live in the engine's KV pool after the
model's own layers, on the same block tables, so they move and are dropped with the
request's blocks. Checkpoint names: NemotronH `mtp.layers.{j}` blocks (`enorm`, `hnorm`,
`eh_proj` on the first, `final_layernorm` on the last) after `mtp_hybrid_override_pattern`;
Qwen `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.{s}` (a
full-attention decoder layer per step) and `mtp.norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.linear import ReplicatedLinear
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.models.sublayer import Sublayer, norm_weight_dtype
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches


class MultiTokenPredictor(nn.Module):
    def __init__(
        self,
        config: HybridModelConfig,
        first_kv_layer: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """`first_kv_layer`: the KV pool layer of the first MTP attention layer."""
        super().__init__()
        hidden = config.hidden_size
        norm_dtype = norm_weight_dtype(config, dtype)
        self.enorm = RMSNorm(hidden, config.norm_eps, norm_dtype, device)
        self.hnorm = RMSNorm(hidden, config.norm_eps, norm_dtype, device)
        # Every rank computes the whole fusion: its output is the residual stream.
        self.fc = ReplicatedLinear(2 * hidden, hidden, False, dtype, device)
        kv_layer = first_kv_layer
        steps = []
        for _ in range(config.num_mtp_steps):
            layers = []
            for kind in config.mtp_layer_kinds:
                index = -1
                if kind == "attention":
                    index, kv_layer = kv_layer, kv_layer + 1
                layers.append(Sublayer(config, kind, index, parallel, dtype, device))
            steps.append(nn.ModuleList(layers))
        self.steps = nn.ModuleList(steps)
        self.final_norm = RMSNorm(hidden, config.norm_eps, norm_dtype, device)

    def forward(
        self,
        step: int,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: StateCaches,
    ) -> torch.Tensor:
        """Prediction step `step` over `batch` (its input_ids the tokens after the positions
        whose hidden states `hidden` are, embedded in `token_embeds`): final-normed (T, H)."""
        fused = torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1)
        out = self.fc(fused)
        for layer in self.steps[step % len(self.steps)]:
            out = out + layer(out, batch, caches)
        return self.final_norm(out)
