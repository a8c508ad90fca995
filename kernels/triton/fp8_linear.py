"""y = x W^T (+ bias) with W stored FP8: a weight-only FP8 GEMM, one program per output tile.

Triton version of `kernels.reference.linear.fp8_linear_ref`. Each program streams its rows of
W once as bytes, decodes them to float in registers, applies each group's scale and
multiplies in x's dtype with float32 accumulation. The activations are not quantised, so the
result is the dequantised weights' (the FP8 checkpoint's oracle) up to summation order; decode
is bound by the weight stream, which FP8 halves against bfloat16.
The bytes are decoded in registers (fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import decode_e4m3
from .launch import dot_precision, strides


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def _fp8_linear_kernel(
    # Pointers
    x,
    weight,
    scale,
    bias,
    out,
    # Dimensions
    M,
    N,
    K,
    group,
    # Strides
    stride_x_m,
    stride_x_k,
    stride_w_n,
    stride_w_k,
    stride_s_n,
    stride_s_g,
    stride_o_m,
    stride_o_n,
    # Meta-parameters
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = o_m < M, o_n < N
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = o_k < K
        p_x = x + o_m[:, None] * stride_x_m + o_k[None, :] * stride_x_k
        b_x = tl.load(p_x, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_n[:, None] & mask_k[None, :]
        p_w = weight + o_n[:, None] * stride_w_n + o_k[None, :] * stride_w_k
        b_w = decode_e4m3(tl.load(p_w, mask=mask_w, other=0))
        # Each column's group scale (a tile may straddle groups of any size).
        p_s = scale + o_n[:, None] * stride_s_n + (o_k // group)[None, :] * stride_s_g
        b_w = b_w * tl.load(p_s, mask=mask_w, other=0.0)
        b_acc += tl.dot(b_x, tl.trans(b_w.to(b_x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    p_o = out + o_m[:, None] * stride_o_m + o_n[None, :] * stride_o_n
    tl.store(p_o, b_acc.to(p_o.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, in), weight float8_e4m3fn (out, in), scale float32 (out, groups) -> (M, out)."""
    rows, (out_features, in_features) = x.shape[0], weight.shape
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _fp8_linear_kernel[grid](
        x,
        weight.view(torch.uint8),
        scale,
        bias,
        out,
        rows,
        out_features,
        in_features,
        group,
        **strides("x", x, "m", "k"),
        **strides("w", weight, "n", "k"),
        **strides("s", scale, "n", "g"),
        **strides("o", out, "m", "n"),
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
