"""RMS norms used by the hybrid models: plain (attention/MLP blocks) and gated (Mamba2 output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in float32, cast back to x.dtype.

    Shapes: x: (..., Dm); weight: (Dm,). Returns (..., Dm).
    """
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def gated_rms_norm_ref(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """h = x * silu(gate), RMS-normalised per contiguous group of `group_size` channels, * weight.

    Shapes: x, gate: (..., Dm) with Dm a multiple of group_size; weight: (Dm,). Returns
    (..., Dm) in x.dtype; all arithmetic is float32. With gate None, h = x.
    """
    Dm = x.shape[-1]
    assert Dm % group_size == 0, f"hidden size {Dm} is not a multiple of group_size {group_size}"
    h = x.float()
    if gate is not None:
        h = h * F.silu(gate.float())
    groups = F.rms_norm(h.unflatten(-1, (Dm // group_size, group_size)), (group_size,), eps=eps)
    return (groups.flatten(-2) * weight.float()).to(x.dtype)
