"""Mixture of experts: a router picks top-k experts per token, plus an optional shared expert
(optionally gated: scaled by sigmoid of a learned per-token logit, as in Qwen3-Next).

Under tensor parallelism every rank routes every token (the router is replicated). By default
(TP-MoE) each rank holds 1/tp of every expert's intermediate dimension; with expert parallelism
it holds whole experts, a contiguous run of them (uneven counts allowed), and computes only the
tokens routed there. Either way each rank's routed output and its share of the shared expert
are partial sums of the layer's output: one all-reduce per layer completes both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import fp8_linear
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.activation import ACTIVATIONS
from hybridserve.workers.layers.linear import ReplicatedLinear, mark_shard, new_param
from hybridserve.workers.layers.mlp import MLP
from hybridserve.workers.models.config import MoESpec


class Router(nn.Module):
    def __init__(
        self, spec: MoESpec, hidden_size: int, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.spec = spec
        if spec.router == "sigmoid_grouped":
            # Routing is precision-sensitive: these stay float32 whatever the model dtype.
            self.weight = new_param(
                spec.num_experts, hidden_size, dtype=torch.float32, device=device
            )
            self.score_bias = (
                new_param(spec.num_experts, dtype=torch.float32, device=device)
                if spec.score_bias
                else None
            )
        else:
            self.weight = new_param(spec.num_experts, hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, Hd) -> expert ids (T, k) and their weights (T, k) float32."""
        spec = self.spec
        if spec.router == "softmax_topk":
            logits = F.linear(hidden, self.weight).float()
            if not spec.norm_topk_prob:  # the chosen experts' probabilities over all experts
                weights, expert_ids = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
                return expert_ids, weights.to(hidden.dtype).float()
            top_logits, expert_ids = logits.topk(spec.top_k, dim=-1)
            return expert_ids, torch.softmax(top_logits, dim=-1).to(hidden.dtype).float()

        scores = F.linear(hidden.float(), self.weight).sigmoid()
        choice = scores if self.score_bias is None else scores + self.score_bias
        # Keep only the best `topk_groups` expert groups (a group scores by its top two experts).
        grouped = choice.view(
            -1, spec.num_expert_groups, spec.num_experts // spec.num_expert_groups
        )
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_ids = group_scores.topk(spec.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
        expert_ids = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.topk_norm_eps)
        return expert_ids, weights * spec.routed_scaling_factor


class Experts(nn.Module):
    """This rank's routed experts as stacked tensors: up (E_local, I_local or 2 I_local, Hin),
    down (E_local, Hin, I_local). TP-MoE: every expert, I / tp of it; expert parallelism:
    experts [first, first + E_local), all of I. Either may be held FP8 (linear.hold_fp8)."""

    fp8_weights = ("up", "down")
    up_scale: nn.Parameter | None
    down_scale: nn.Parameter | None
    up_group = down_group = 0

    def __init__(
        self,
        spec: MoESpec,
        input_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.register_parameter("up_scale", None)
        self.register_parameter("down_scale", None)
        self.gated = spec.gated
        self.act = ACTIVATIONS[spec.activation]
        size = spec.intermediate_size
        num_up = 2 if spec.gated else 1  # [gate | up] rows
        if parallel.expert_parallel:
            self.first_expert, num_local = parallel.expert_range(spec.num_experts)
            local = size
            expert_rows = [(self.first_expert, num_local)]
            self.up = mark_shard(
                new_param(num_local, local * num_up, input_size, dtype=dtype, device=device),
                0,
                expert_rows,
            )
            self.down = mark_shard(
                new_param(num_local, input_size, local, dtype=dtype, device=device), 0, expert_rows
            )
        else:
            self.first_expert, num_local = 0, spec.num_experts
            local = parallel.split(size, "moe_intermediate_size")
            rows = (parallel.tp_rank * local, local)
            self.up = mark_shard(
                new_param(num_local, local * num_up, input_size, dtype=dtype, device=device),
                1,
                [(rows[0] + k * size, local) for k in range(num_up)],
            )
            self.down = mark_shard(
                new_param(num_local, input_size, local, dtype=dtype, device=device), 2, [rows]
            )

    def forward(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden (T, Hin), expert_ids / weights (T, k) -> (T, Hin) float32 partial sums."""
        top_k = expert_ids.shape[1]
        num_local = self.up.shape[0]
        # Local expert index of every (token, choice); choices routed elsewhere count in the
        # extra bin `num_local` and are skipped.
        local_ids = expert_ids.flatten() - self.first_expert
        local_ids = torch.where((local_ids >= 0) & (local_ids < num_local), local_ids, num_local)
        order = local_ids.argsort(stable=True)
        token_ids = order // top_k
        counts = torch.bincount(local_ids, minlength=num_local + 1).tolist()
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        start = 0
        for expert, count in enumerate(counts[:num_local]):
            if count == 0:
                continue
            rows = order[start : start + count]
            tokens = token_ids[start : start + count]
            start += count
            projected = self._project(hidden[tokens], "up", expert)
            if self.gated:
                gate, up = projected.chunk(2, dim=-1)
                activated = self.act(gate) * up
            else:
                activated = self.act(projected)
            expert_out = self._project(activated, "down", expert)
            out.index_add_(0, tokens, expert_out.float() * weights.flatten()[rows, None])
        return out

    def _project(self, x: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        """x times expert `expert`'s `name` ("up" or "down") weight, transposed."""
        weight, scale = getattr(self, name)[expert], getattr(self, f"{name}_scale")
        if scale is None:
            return F.linear(x, weight)
        return fp8_linear(x, weight, scale[expert], getattr(self, f"{name}_group"))


class MoE(nn.Module):
    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.router = Router(spec, hidden_size, dtype, device)
        expert_input = spec.latent_size or hidden_size
        # NemotronH's optional latent space: experts run on a narrower projection of the input.
        self.latent_in = self.latent_out = None
        if spec.latent_size is not None:
            self.latent_in = ReplicatedLinear(hidden_size, spec.latent_size, False, dtype, device)
            self.latent_out = ReplicatedLinear(spec.latent_size, hidden_size, False, dtype, device)
        self.experts = Experts(spec, expert_input, parallel, dtype, device)
        self.shared = (
            MLP(spec.shared, hidden_size, parallel, dtype, device, reduce=False)
            if spec.shared is not None
            else None
        )
        self.shared_gate = (
            ReplicatedLinear(hidden_size, 1, False, dtype, device) if spec.shared_gate else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.router(hidden)
        routed_input = hidden if self.latent_in is None else self.latent_in(hidden)
        # Partial sums on every rank (latent_out is linear without bias, so it can map the
        # partial before the reduction).
        out = self.experts(routed_input, expert_ids, weights).to(hidden.dtype)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared is not None:
            shared = self.shared(hidden)
            if self.shared_gate is not None:
                # A per-token scale of every rank's partial sum: the reduction keeps it.
                shared = torch.sigmoid(self.shared_gate(hidden)) * shared
            out = out + shared
        return self.parallel.reduce(out)
