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
            self.gate_up_proj = ColumnParallelLinear(
                hidden_size, split_ranges([size, size], parallel), spec.bias, **common
            )
        else:
            self.up_proj = ColumnParallelLinear(
                hidden_size, split_ranges([size], parallel), spec.bias, **common
            )
        self.down_proj = RowParallelLinear(
            size, hidden_size, spec.bias, parallel, name="down_proj", reduce=reduce, **common
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.up_proj(hidden)))
