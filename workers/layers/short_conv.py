"""The gated short convolution of LFM2: in_proj -> B * x -> causal depthwise conv -> C * conv
-> out_proj.

    in_proj rows:  B (hidden) | C (hidden) | x (hidden)
    y = C * conv(B * x)          (no activation; the conv may have a bias)

Its per-sequence state is the conv window over B * x (the `short_conv` kind of
models/recurrent_state.py), kept in a state slot like every recurrent layer's: decode rows shift
one input into it; prefill sequences run the varlen conv from zero (first chunk) or from the
live slot. Under tensor parallelism each rank holds 1/tp of the channels (B, C, x rows, the
conv, the window); out_proj is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.causal_conv import causal_conv
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_shard,
    new_param,
    section_ranges,
)
from hybridserve.workers.models.config import ShortConvSpec
from hybridserve.workers.runner.forward_batch import ForwardBatch, RecurrentLayer


class ShortConv(nn.Module):
    def __init__(
        self,
        spec: ShortConvSpec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.channels = parallel.split(spec.channels, "hidden_size (short conv channels)")
        rows = (parallel.tp_rank * self.channels, self.channels)
        self.in_proj = ColumnParallelLinear(
            hidden_size, section_ranges([(rows, spec.channels)] * 3), spec.bias, dtype, device
        )
        self.conv_weight = mark_shard(
            new_param(self.channels, 1, spec.conv_kernel, dtype=dtype, device=device), 0, [rows]
        )
        self.conv_bias = (
            mark_shard(new_param(self.channels, dtype=dtype, device=device), 0, [rows])
            if spec.bias
            else None
        )
        self.out_proj = RowParallelLinear(
            spec.channels, hidden_size, spec.bias, parallel, dtype, device, name="conv out_proj"
        )

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, state: RecurrentLayer
    ) -> torch.Tensor:
        B, C, x = self.in_proj(hidden).split(self.channels, dim=-1)
        weight = self.conv_weight[:, 0, :]
        convolved = causal_conv(B * x, weight, self.conv_bias, batch, state, activation=None)
        return self.out_proj(C * convolved)
