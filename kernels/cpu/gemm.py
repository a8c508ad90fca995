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
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    rows, (out, inner) = x.shape[0], weight.shape
    y = torch.empty((rows, out), dtype=torch.float32)
    kernel(
        weight.data_ptr(),
        out,
        inner,
        x.data_ptr(),
        rows,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
    )
    return y
