"""Mamba1 mixer (Jamba): in_proj -> causal conv -> x_proj -> RMSNorms on dt, B, C -> dt_proj
-> selective scan -> gate -> out_proj.

    in_proj rows:   x (channels) | z (channels)
    x_proj rows:    dt (dt_rank) | B (state_size) | C (state_size)
    y = scan(conv(x), dt_proj(norm(dt)), norm(B), norm(C)) * silu(z)

The scan's decay is per channel and state column (A is channels x state_size), so it runs as
its own kernels (kernels/reference/mamba1.py, Triton and C twins). State per sequence lives
in a state slot (this layer's conv window and SSM rows: the Mamba1 kind of
models/recurrent_state.py): decode rows advance it by one token, prefill sequences run the
varlen conv and scan from zero (first chunk) or from the live slot.

Under tensor parallelism each rank holds 1/tp of the channels (x, z, the conv, dt_proj's rows,
A, D, the state). x_proj reads every channel, so it is row-parallel: its dt | B | C, a few
dozen values per token, are all-reduced, and every rank then normalises them in full.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import mamba1_scan, mamba1_update_pooled
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.causal_conv import causal_conv
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_shard,
    new_param,
    section_ranges,
)
from hybridserve.workers.layers.norm import RMSNorm
from hybridserve.workers.models.config import Mamba1Spec
from hybridserve.workers.runner.forward_batch import ForwardBatch, RecurrentLayer


class Mamba1Mixer(nn.Module):
    def __init__(
        self,
        spec: Mamba1Spec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        inner = spec.intermediate_size
        self.channels = parallel.split(inner, "mamba intermediate size")
        rows = [(parallel.tp_rank * self.channels, self.channels)]
        self.in_proj = ColumnParallelLinear(
            hidden_size, section_ranges([(rows[0], inner)] * 2), spec.proj_bias, dtype, device
        )
        self.conv_weight = mark_shard(
            new_param(self.channels, 1, spec.conv_kernel, dtype=dtype, device=device), 0, rows
        )
        self.conv_bias = (
            mark_shard(new_param(self.channels, dtype=dtype, device=device), 0, rows)
            if spec.conv_bias
            else None
        )
        self.x_proj = RowParallelLinear(
            inner,
            spec.dt_rank + 2 * spec.state_size,
            False,
            parallel,
            dtype,
            device,
            name="mamba x_proj",
        )
        self.dt_norm = RMSNorm(spec.dt_rank, spec.norm_eps, dtype, device)
        self.B_norm = RMSNorm(spec.state_size, spec.norm_eps, dtype, device)
        self.C_norm = RMSNorm(spec.state_size, spec.norm_eps, dtype, device)
        # dt_proj's bias is added inside the scan, before its softplus.
        self.dt_proj = ColumnParallelLinear(spec.dt_rank, rows, False, dtype, device)
        self.dt_bias = mark_shard(new_param(self.channels, dtype=dtype, device=device), 0, rows)
        self.A_log = mark_shard(
            new_param(self.channels, spec.state_size, dtype=dtype, device=device), 0, rows
        )
        self.D = mark_shard(new_param(self.channels, dtype=dtype, device=device), 0, rows)
        self.out_proj = RowParallelLinear(
            inner, hidden_size, spec.proj_bias, parallel, dtype, device, name="mamba out_proj"
        )

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, state: RecurrentLayer
    ) -> torch.Tensor:
        spec = self.spec
        x, z = self.in_proj(hidden).split(self.channels, dim=-1)
        weight = self.conv_weight[:, 0, :]
        x = causal_conv(x, weight, self.conv_bias, batch, state, activation="silu")
        nd = batch.num_decode
        dt, B, C = self.x_proj(x).split([spec.dt_rank, spec.state_size, spec.state_size], dim=-1)
        dt = self.dt_proj(self.dt_norm(dt))
        B, C = self.B_norm(B), self.C_norm(C)
        A = -torch.exp(self.A_log.float())
        scan_args = {"D": self.D, "dt_bias": self.dt_bias}
        ys = []
        if nd:
            ys.append(
                mamba1_update_pooled(
                    state.pools["ssm"],
                    state.layer,
                    x[:nd],
                    dt[:nd],
                    A,
                    B[:nd],
                    C[:nd],
                    state_slots=batch.state_slots[:nd],
                    **scan_args,
                )
            )
        if hidden.shape[0] > nd:
            ys.append(
                mamba1_scan(
                    x[nd:],
                    dt[nd:],
                    A,
                    B[nd:],
                    C[nd:],
                    cu_seqlens=batch.prefill_cu_seqlens,
                    ssm_states=state.views["ssm"],
                    initial_state_slots=batch.prefill_initial_slots,
                    final_state_slots=batch.state_slots[nd:],
                    **scan_args,
                )
            )
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return self.out_proj((y.float() * F.silu(z.float())).to(y.dtype))
