"""y = x weight^T + bias: torch's own GEMM, the reference of the CPU small-batch kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: (M, in), weight: (out, in), bias: (out,) or None -> (M, out)."""
    return F.linear(x, weight, bias)
