"""Small-batch matrix multiply on the CPU through oneDNN with pre-packed weights.

Decode steps multiply a handful of rows by every weight matrix. For those, oneDNN with the
weight reordered once into its blocked layout is 1.3-2.5x faster than the default GEMM; for
large prefill batches the default GEMM is as fast or faster. So layers keep their plain weight
and may add a packed copy, and `linear` picks per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows at or below which the packed weight is used (measured crossover is between 64 and 300).
SMALL_BATCH = 64
# The batch size oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) -> an opaque oneDNN-packed copy for `linear(..., packed=...)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x weight^T + bias; x: (M, in), weight: (out, in)."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
