"""Mamba2 mixer: in_proj -> causal conv -> selective scan -> gated RMSNorm -> out_proj (or,
per `MambaSpec.gate`, the norm before the gate, or the gate alone).

State per sequence lives in a state slot (this layer's conv window and SSM state: the Mamba2
kind of models/recurrent_state.py). Decode rows
advance it by one token with the single-step kernels; prefill sequences run the varlen conv and
chunked scan, starting from zero (first chunk) or from the live slot (every later chunk).

Under tensor parallelism each rank holds 1/tp of the heads (z, x, dt, the x conv channels, the
SSM state). B and C come in `n_groups` groups, each read by a run of consecutive heads: with at
least as many groups as ranks they are split too; with fewer, each rank holds the one group its
heads read (replicated over tp / n_groups ranks). The gated norm normalises per group: a group
whole on a rank is normalised there; one spread over several ranks sums its squares across them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import gated_rms_norm, mamba_chunk_scan, state_update_pooled
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.causal_conv import causal_conv
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_shard,
    new_param,
    section_ranges,
)
from hybridserve.workers.models.config import MambaSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, RecurrentLayer


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
        self.parallel = parallel
        inner, group_state, heads = (spec.intermediate_size, spec.group_state_size, spec.num_heads)
        self.num_heads = parallel.split(heads, "mamba_num_heads")
        self.intermediate = self.num_heads * spec.head_dim
        group_rows = parallel.piece(group_state, spec.n_groups)  # this rank's B (and C) rows
        self.group_state = group_rows[1]
        self.n_groups = self.group_state // spec.state_size
        # A norm group spans ranks when groups are replicated: rank r's heads are part of
        # group `norm_group` (its sum of squares is completed across ranks).
        self.norm_spans_ranks = spec.n_groups < parallel.tp_size
        self.norm_group = group_rows[0] // spec.state_size
        head_rows = (parallel.tp_rank * self.intermediate, self.intermediate)
        dt_rows = (parallel.tp_rank * self.num_heads, self.num_heads)

        # conv channels: x | B | C; in_proj rows: z (gate) | x | B | C | dt.
        xbc = [(head_rows, inner), (group_rows, group_state), (group_rows, group_state)]
        self.in_proj = ColumnParallelLinear(
            hidden_size,
            section_ranges([(head_rows, inner), *xbc, (dt_rows, heads)]),
            spec.proj_bias,
            dtype,
            device,
        )
        conv_rows = section_ranges(xbc)
        conv_local = self.intermediate + 2 * self.group_state
        self.conv_weight = mark_shard(
            new_param(conv_local, 1, spec.conv_kernel, dtype=dtype, device=device), 0, conv_rows
        )
        self.conv_bias = (
            mark_shard(new_param(conv_local, dtype=dtype, device=device), 0, conv_rows)
            if spec.conv_bias
            else None
        )
        self.dt_bias = mark_shard(
            new_param(self.num_heads, dtype=dtype, device=device), 0, [dt_rows]
        )
        self.A_log = mark_shard(new_param(self.num_heads, dtype=dtype, device=device), 0, [dt_rows])
        self.D = mark_shard(new_param(self.num_heads, dtype=dtype, device=device), 0, [dt_rows])
        self.norm_weight = (
            mark_shard(new_param(self.intermediate, dtype=dtype, device=device), 0, [head_rows])
            if spec.gate != "no_norm"
            else None
        )
        self.out_proj = RowParallelLinear(
            inner, hidden_size, spec.proj_bias, parallel, dtype, device, name="mamba out_proj"
        )

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, state: RecurrentLayer
    ) -> torch.Tensor:
        spec = self.spec
        ssm_states = state.views["ssm"]
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
        conv_out = causal_conv(xbc, conv_weight, self.conv_bias, batch, state, spec.activation)

        nd = batch.num_decode
        outputs = []
        if nd:
            slots = batch.state_slots[:nd]
            x, B, C = conv_out[:nd].split(split, dim=-1)
            step_args = (
                x.view(nd, heads, head_dim),
                dt[:nd],
                A,
                B.view(nd, groups, dstate),
                C.view(nd, groups, dstate),
            )
            # Through (pool, layer): a step the compiled path traces writes the pools in place.
            outputs.append(
                state_update_pooled(
                    state.pools["ssm"], state.layer, *step_args, state_slots=slots, **scan_args
                )
            )
        if num_tokens > nd:
            slots = batch.state_slots[nd:]
            num_prefill = num_tokens - nd
            x, B, C = conv_out[nd:].split(split, dim=-1)
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
        y = y.reshape(num_tokens, self.intermediate)
        if spec.gate == "no_norm":
            y = (y.float() * F.silu(z.float())).to(y.dtype)
        elif spec.gate == "norm_before_gate":
            y = (self._group_norm(y.float()) * F.silu(z.float())).to(y.dtype)
        elif self.norm_spans_ranks:
            y = self._group_norm(y.float() * F.silu(z.float())).to(y.dtype)
        else:
            group_size = self.intermediate // groups
            y = gated_rms_norm(y, z, self.norm_weight, group_size=group_size, eps=spec.norm_eps)
        return self.out_proj(y)

    def _group_norm(self, h: torch.Tensor) -> torch.Tensor:
        """RMSNorm of float32 `h` per norm group, times the weight. Where this rank holds only
        part of its group, each rank's sum of squares goes into its group's column and one
        all-reduce completes every group.

            rank:     0        1        2        3          (n_groups 2, tp 4)
            channels: [ group 0 ........ ][ group 1 ........ ]
        """
        assert self.norm_weight is not None
        spec = self.spec
        if self.norm_spans_ranks:
            sums = h.new_zeros(h.shape[0], spec.n_groups)
            sums[:, self.norm_group] = h.square().sum(dim=-1)
            group_size = spec.intermediate_size // spec.n_groups
            variance = self.parallel.reduce(sums)[:, self.norm_group] / group_size
            normed = h * torch.rsqrt(variance + spec.norm_eps)[:, None]
        else:
            grouped = h.view(h.shape[0], self.n_groups, -1)
            variance = grouped.square().mean(dim=-1, keepdim=True)
            normed = (grouped * torch.rsqrt(variance + spec.norm_eps)).view_as(h)
        return normed * self.norm_weight.float()
