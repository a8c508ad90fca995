"""Small-batch matrix multiply on the CPU: a C mat-vec up to eight rows, oneDNN with
pre-packed weights up to 64.

Decode steps multiply a handful of rows by every weight matrix. For those, oneDNN with the
weight reordered once into its blocked layout is 1.3-2.5x faster than the default GEMM; for
large prefill batches the default GEMM is as fast or faster. So layers keep their plain weight
and may add a packed copy, and `linear` picks per call. At a few rows the multiply only
streams the weight once, and a loop of dot products four weight rows at a time
(`GEMV_SOURCE`, built by `library`) keeps up with that stream where oneDNN does not: on the
benchmark checkpoint's 80 MB of weights, 2.0 against 3.4 ms at one row, 4.7 against 5.1 at
eight (figures at `GEMV_ROWS`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridserve.kernels.cpu import library
from hybridserve.kernels.dispatch import BACKEND_ENV
from hybridserve.kernels.reference.linear import dequantize_fp8

# An FP8 weight above GEMV_ROWS rows is dequantised this many floats at a time, each piece
# multiplied as it is made (4 MiB: it stays in L2/L3 for the GEMM that reads it).
FP8_TILE_FLOATS = 1 << 20
# Rows at or below which the packed weight is used (measured crossover is between 64 and 300).
SMALL_BATCH = 64
# The batch size oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32
# Rows at or below which the C mat-vec is used. Every weight of the benchmark checkpoint once,
# same process: 2.0 / 2.4 / 3.1 / 4.7 / 8.1 ms at 1 / 2 / 4 / 8 / 16 rows against oneDNN's
# packed GEMM's 3.4 / 3.5 / 3.7 / 5.1 / 6.7 ms; they cross between 8 and 16.
GEMV_ROWS = 8


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
    if x.dim() == 2 and x.shape[0] <= GEMV_ROWS and _gemv_applies(x, weight, bias):
        return _gemv(x, weight, bias)
    if packed is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        not torch.compiler.is_compiling()  # traced GEMMs go through `packed_linear`
        and weight.device.type == "cpu"
        and weight.dtype == x.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_grad_enabled()
        and gemv_kernel() is not None
    )


@functools.cache
def gemv_kernel() -> ctypes._CFuncPtr | None:
    # HYBRIDSERVE_KERNEL_BACKEND=reference means torch everywhere (read once per process).
    if os.environ.get(BACKEND_ENV) == "reference":
        return None
    argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return library.function("gemm.c", "gemv_f32", argtypes)


@functools.cache
def gemv_each_kernel() -> ctypes._CFuncPtr | None:
    """`gemv_each_f32(count, W, out, in, x, rows, y)` (arrays of `count` pointers and sizes),
    or None where the mat-vec does not build."""
    if gemv_kernel() is None:
        return None
    argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return library.function("gemm.c", "gemv_each_f32", argtypes)


def gemv_each(
    weights: list[torch.Tensor], inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> Callable[[], None] | None:
    """A call that runs outputs[i] = inputs[i] weights[i]^T for every i in one parallel region
    (contiguous fp32 CPU tensors, inputs of equally many rows), its arguments built once; None
    where the mat-vec does not build."""
    kernel = gemv_each_kernel()
    if kernel is None:
        return None

    def addresses(tensors: list[torch.Tensor]) -> ctypes.Array:
        return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))

    def sizes(values: list[int]) -> ctypes.Array:
        return (ctypes.c_int64 * len(values))(*values)

    arguments = (
        len(weights),
        addresses(weights),
        sizes([w.shape[0] for w in weights]),
        sizes([w.shape[1] for w in weights]),
        addresses(inputs),
        inputs[0].shape[0],
        addresses(outputs),
    )
    return lambda: kernel(*arguments)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = gemv_kernel()
    assert kernel is not None
    return _matvec(kernel, (weight.data_ptr(), *weight.shape), x, bias, weight.shape[0])


def _matvec(
    kernel: ctypes._CFuncPtr,
    weight: tuple[int, ...],
    x: torch.Tensor,
    bias: torch.Tensor | None,
    out: int,
) -> torch.Tensor:
    """`kernel(*weight, x, rows, bias, y)`, a C mat-vec whose weight is described by the
    `weight` arguments: y = x W^T + bias, (rows, out) float32."""
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty((x.shape[0], out), dtype=torch.float32)
    kernel(*weight, x.data_ptr(), x.shape[0], None if bias is None else bias.data_ptr(),
           y.data_ptr())  # fmt: skip
    return y


@functools.cache
def gemv_fp8_kernel() -> ctypes._CFuncPtr | None:
    """`gemv_fp8(W, scale, out, in, group, x, rows, bias, y)`, or None where it does not
    build."""
    if gemv_kernel() is None:
        return None
    argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return library.function("gemm.c", "gemv_fp8", [*argtypes, ctypes.c_void_p])


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias with W float8_e4m3fn (out, in) and float32 scales (out, groups): the
    C mat-vec up to GEMV_ROWS rows (the weight read as bytes), else torch's GEMM over pieces
    of W dequantised as they are needed (the whole float weight never exists)."""
    kernel = gemv_fp8_kernel()
    if (
        kernel is not None
        and x.dim() == 2
        and x.shape[0] <= GEMV_ROWS
        and x.dtype == torch.float32
        and weight.is_contiguous()
        and scale.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and not torch.compiler.is_compiling()
    ):
        out, inner = weight.shape
        described = (weight.data_ptr(), scale.data_ptr(), out, inner, group)
        return _matvec(kernel, described, x, bias, out)
    step = max(1, FP8_TILE_FLOATS // weight.shape[1])
    pieces = [
        F.linear(x, dequantize_fp8(weight[start : start + step], scale[start : start + step],
                                   group, x.dtype))
        for start in range(0, weight.shape[0], step)
    ]  # fmt: skip
    y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    return y if bias is None else y + bias
