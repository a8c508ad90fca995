"""Mamba2 mixer: in_proj -> causal conv -> selective scan -> gated RMSNorm -> out_proj.

State per sequence lives in a Mamba slot (conv window + SSM state for this layer). Decode rows
advance it by one token with the single-step kernels; prefill sequences run the varlen conv and
chunked scan, starting from zero (first chunk) or from the live slot (every later chunk).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    mamba_chunk_scan,
    selective_state_update,
)
from hybridserve.workers.forward_batch import ForwardBatch
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    mark_shard,
    new_param,
)
from hybridserve.workers.models.config import MambaSpec


class MambaMixer(nn.Module):
    def __init__(
        self,
        spec: MambaSpec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.num_heads = parallel.split(spec.num_heads, "mamba_num_heads")
        self.n_groups = parallel.split(spec.n_groups, "mamba_n_groups")
        self.intermediate = self.num_heads * spec.head_dim
        self.group_state = self.n_groups * spec.state_size
        inner, group_state, heads = (spec.intermediate_size, spec.group_state_size, spec.num_heads)
        common = {"parallel": parallel, "dtype": dtype, "device": device}
        # in_proj rows: z (gate) | x | B | C | dt; each section is split across ranks separately.
        self.in_proj = ColumnParallelLinear(
            hidden_size,
            [inner, inner, group_state, group_state, heads],
            spec.proj_bias,
            name="mamba in_proj",
            **common,
        )
        conv_sections = [inner, group_state, group_state]
        conv_local = self.intermediate + 2 * self.group_state
        self.conv_weight = mark_shard(
            new_param(conv_local, 1, spec.conv_kernel, dtype=dtype, device=device), 0, conv_sections
        )
        self.conv_bias = (
            mark_shard(new_param(conv_local, dtype=dtype, device=device), 0, conv_sections)
            if spec.conv_bias
            else None
        )
        self.dt_bias = mark_shard(new_param(self.num_heads, dtype=dtype, device=device), 0, [heads])
        self.A_log = mark_shard(new_param(self.num_heads, dtype=dtype, device=device), 0, [heads])
        self.D = mark_shard(new_param(self.num_heads, dtype=dtype, device=device), 0, [heads])
        self.norm_weight = mark_shard(
            new_param(self.intermediate, dtype=dtype, device=device), 0, [inner]
        )
        self.out_proj = RowParallelLinear(
            inner, hidden_size, spec.proj_bias, name="mamba out_proj", **common
        )

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, state: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        spec = self.spec
        conv_states, ssm_states = state
        num_tokens = hidden.shape[0]
        heads, head_dim, groups, dstate = (
            self.num_heads,
            spec.head_dim,
            self.n_groups,
            spec.state_size,
        )
        z, xbc, dt = self.in_proj(hidden).split(
            [self.intermediate, self.intermediate + 2 * self.group_state, heads], dim=-1
        )
        A = -torch.exp(self.A_log.float())
        conv_weight = self.conv_weight[:, 0, :]
        scan_args = {
            "D": self.D,
            "dt_bias": self.dt_bias,
            "dt_softplus": True,
            "dt_limit": (spec.dt_min, spec.dt_max),
        }
        split = [self.intermediate, self.group_state, self.group_state]

        nd = batch.num_decode
        outputs = []
        if nd:
            slots = batch.mamba_slots[:nd]
            conv_out = causal_conv1d_update(
                xbc[:nd],
                conv_weight,
                self.conv_bias,
                conv_states=conv_states,
                state_slots=slots,
                activation=spec.activation,
            )
            x, B, C = conv_out.split(split, dim=-1)
            outputs.append(
                selective_state_update(
                    ssm_states,
                    x.view(nd, heads, head_dim),
                    dt[:nd],
                    A,
                    B.view(nd, groups, dstate),
                    C.view(nd, groups, dstate),
                    state_slots=slots,
                    **scan_args,
                )
            )
        if num_tokens > nd:
            slots = batch.mamba_slots[nd:]
            num_prefill = num_tokens - nd
            conv_out = causal_conv1d(
                xbc[nd:],
                conv_weight,
                self.conv_bias,
                cu_seqlens=batch.prefill_cu_seqlens,
                conv_states=conv_states,
                initial_state_slots=batch.prefill_initial_slots,
                final_state_slots=slots,
                activation=spec.activation,
            ).out
            x, B, C = conv_out.split(split, dim=-1)
            outputs.append(
                mamba_chunk_scan(
                    x.reshape(num_prefill, heads, head_dim),
                    dt[nd:],
                    A,
                    B.reshape(num_prefill, groups, dstate),
                    C.reshape(num_prefill, groups, dstate),
                    chunk_size=spec.chunk_size,
                    cu_seqlens=batch.prefill_cu_seqlens,
                    ssm_states=ssm_states,
                    initial_state_slots=batch.prefill_initial_slots,
                    final_state_slots=slots,
                    **scan_args,
                ).out
            )
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        y = gated_rms_norm(
            y.reshape(num_tokens, self.intermediate),
            z,
            self.norm_weight,
            group_size=self.intermediate // groups,
            eps=spec.norm_eps,
        )
        return self.out_proj(y)
