"""y = x weight^T + bias: torch's own GEMM, the reference of the CPU small-batch kernels; and
the same with an FP8 weight, dequantised first, the reference of the FP8 GEMMs.

An FP8 weight is float8_e4m3fn (..., out, in) with float32 scales (..., out, groups): scale
[o, g] multiplies columns [g * group, (g + 1) * group) of row o (the last group may be short).
Block-wise checkpoints (128 x 128 blocks) become group = 128 with each block's scale repeated
over its rows; per-channel and per-tensor scales become one group of all columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: (M, in), weight: (out, in), bias: (out,) or None -> (M, out)."""
    return F.linear(x, weight, bias)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight an FP8 `weight` with `scale` per `group` columns stands for."""
    columns = weight.shape[-1]
    per_column = scale.repeat_interleave(group, dim=-1)[..., :columns]
    return (weight.float() * per_column).to(dtype)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, in) times the dequantised FP8 weight (out, in), in x's dtype -> (M, out)."""
    return F.linear(x, dequantize_fp8(weight, scale, group, x.dtype), bias)
