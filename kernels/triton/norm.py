"""Gated RMS norm (the Mamba2 output norm), one program per (row, group).

Triton version of `kernels.reference.norm.gated_rms_norm_ref`. A group is `group_size`
contiguous channels; the whole group sits in registers, so one pass computes the mean square and
a second, register-only pass scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import strides


@triton.heuristics({"HAS_GATE": lambda args: args["gate"] is not None})
@triton.jit
def _gated_rms_norm_kernel(
    # Pointers
    x,
    gate,
    weight,
    out,
    # Dimensions and scalars
    group_size,
    eps,
    # Strides
    stride_x_m,
    stride_x_d,
    stride_g_m,
    stride_g_d,
    stride_w_d,
    stride_o_m,
    stride_o_d,
    # Meta-parameters
    HAS_GATE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_g * group_size + tl.arange(0, BLOCK_D)
    mask_d = tl.arange(0, BLOCK_D) < group_size

    b_h = tl.load(x + i_m * stride_x_m + o_d * stride_x_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_GATE:
        p_g = gate + i_m * stride_g_m + o_d * stride_g_d
        b_g = tl.load(p_g, mask=mask_d, other=0.0).to(tl.float32)
        b_h = b_h * b_g * tl.sigmoid(b_g)
    # Masked lanes hold 0 and add nothing to the sum of squares.
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_h * b_h, axis=0) / group_size + eps)
    b_w = tl.load(weight + o_d * stride_w_d, mask=mask_d, other=0.0).to(tl.float32)
    p_o = out + i_m * stride_o_m + o_d * stride_o_d
    tl.store(p_o, (b_h * b_rstd * b_w).to(p_o.dtype.element_ty), mask=mask_d)


def _gated_rms_norm_fwd(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    Dm = x.shape[-1]
    assert Dm % group_size == 0, f"hidden size {Dm} is not a multiple of group_size {group_size}"
    assert weight.shape == (Dm,), weight.shape
    assert gate is None or gate.shape == x.shape, (gate.shape, x.shape)

    # (..., Dm) -> (M, Dm); reshape copies only when the leading dims cannot be flattened.
    x2 = x.reshape(-1, Dm)
    g2 = gate.reshape(-1, Dm) if gate is not None else None
    M = x2.shape[0]
    out = torch.empty((M, Dm), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.view(x.shape)
    BLOCK_D = triton.next_power_of_2(group_size)
    # NOTE: the group lives in registers; 16K float32 over 8 warps is 64 per thread.
    assert BLOCK_D <= 16384, f"group_size {group_size} is too large for one block"
    num_warps = min(max(BLOCK_D // 512, 1), 8)
    grid = (M, Dm // group_size)
    _gated_rms_norm_kernel[grid](
        x=x2,
        gate=g2,
        weight=weight,
        out=out,
        group_size=group_size,
        eps=eps,
        **strides("x", x2, "m", "d"),
        **strides("g", g2, "m", "d"),
        **strides("w", weight, "d"),
        **strides("o", out, "m", "d"),
        BLOCK_D=BLOCK_D,
        num_warps=num_warps,
    )
    return out.view(x.shape)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """h = x * silu(gate), RMS-normalised per contiguous group of `group_size` channels, * weight.

    Shapes: x, gate: (..., Dm) with Dm a multiple of group_size; weight: (Dm,). Returns
    (..., Dm) in x.dtype (a new contiguous tensor); all arithmetic is float32. With gate None,
    h = x.
    """
    return _gated_rms_norm_fwd(x, gate, weight, group_size, eps)
