"""RMSNorm as a module (the math lives in `hybridserve.kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import rms_norm
from hybridserve.workers.layers.linear import new_param


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
