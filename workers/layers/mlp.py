"""Dense feed-forward: gated (act(gate) * up) or plain (act(up))."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.activation import ACTIVATIONS
from hybridserve.workers.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_ranges,
)
from hybridserve.workers.layers.low_rank import LowRankAdapter
from hybridserve.workers.models.config import MLPSpec


class MLP(nn.Module):
    def __init__(
        self,
        spec: MLPSpec,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        *,
        reduce: bool = True,
    ) -> None:
        """With `reduce=False` the output is this rank's partial sum (see RowParallelLinear)."""
        super().__init__()
        self.gated = spec.gated
        self.activation = spec.activation  # the checkpoint's name (the native decode step)
        self.act = ACTIVATIONS[spec.activation]
        common = {"dtype": dtype, "device": device}
        size = spec.intermediate_size
        if spec.gated:
            # Fused [gate | up] rows, each half split across ranks on its own.
            self.up_rows = split_ranges([size, size], parallel)
            self.gate_up_proj = ColumnParallelLinear(hidden_size, self.up_rows, spec.bias, **common)
        else:
            self.up_rows = split_ranges([size], parallel)
            self.up_proj = ColumnParallelLinear(hidden_size, self.up_rows, spec.bias, **common)
        self.down_proj = RowParallelLinear(
            size, hidden_size, spec.bias, parallel, name="down_proj", reduce=reduce, **common
        )

    def forward(self, hidden: torch.Tensor, adapter: LowRankAdapter | None = None) -> torch.Tensor:
        """`adapter`: a low-rank term added to the up (or gate | up) projection (a Zamba2
        invocation's)."""
        up = self.gate_up_proj(hidden) if self.gated else self.up_proj(hidden)
        if adapter is not None:
            up = up + adapter(hidden)
        if self.gated:
            gate, up = up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(up))
