"""Small-batch matrix multiply on the CPU through oneDNN with pre-packed weights.

Decode steps multiply a handful of rows by every weight matrix. For those, oneDNN with the
weight reordered once into its blocked layout is 1.3-2.5x faster than the default GEMM; for
large prefill batches the default GEMM is as fast or faster. So layers keep their plain weight
and may add a packed copy, and `linear` picks per call.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# Rows at or below which the packed weight is used (measured crossover is between 64 and 300).
SMALL_BATCH = 64
# The batch size oneDNN tunes the packed layout for: a typical decode batch.
_PACK_BATCH_HINT = 32
# Packed weights by their plain weight's data pointer, for `packed_linear`; the layer that
# packed a weight owns both.
_packed_by_address: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


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


def register_packed(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """Let `packed_linear(x, weight, ...)` find `packed` while its owner keeps it alive."""
    _packed_by_address[weight.data_ptr()] = packed


# `packed_linear`: `linear` with `weight`'s registered packed copy, as one opaque operator.
# The compiled decode step calls the GEMM through it, because torch.compile cannot trace
# oneDNN's packed tensors (and its own packing, under `freezing`, picks MKL's slower GEMM and
# keeps a third copy of every weight). The copy is found by the weight's address, not passed
# as a constant, so every engine of one model compiles the same graph (inductor's cache hits).
# A plain library definition with a CPU kernel, not `torch.library.custom_op`: the latter's
# Python wrappers cost about 12 us a call, 0.3 ms of a 28-GEMM decode step; this costs ~2 us.
_LIBRARY = torch.library.Library("hybridserve", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return linear(x, weight, bias, _packed_by_address.get(weight.data_ptr()))


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("hybridserve::packed_linear")
def _packed_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


packed_linear = torch.ops.hybridserve.packed_linear.default
