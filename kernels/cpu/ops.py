"""The CPU implementations of the torch operators of kernels/operators.py: C++ in
csrc/ops.cpp, built against this process's torch (`library.load_torch_operators`, ~10 s the
first time on a machine, then cached) and registered for CPU tensors. They call the C
kernels of state_update.c, attention.c and gemm.c, whose addresses they get once from their
ctypes handles (`bind_cpu_kernels`), so a call from a compiled step's generated code reaches
the kernel with no Python in between (in Python, each of the 36 calls of a one-row step cost
10-20 us).

The C++ side also keeps the packed weights `packed_linear` finds by address: weak references,
so the layer that packed a weight owns both and an entry whose copy is gone is dropped.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from hybridserve.kernels import operators  # noqa: F401  (the schemas the C++ implements)
from hybridserve.kernels.cpu import attention, gemm, library, state_update
from hybridserve.kernels.dispatch import BACKEND_ENV


@functools.cache
def build() -> bool:
    """Build (or find in the cache) the C kernels and the operators' C++, load them and bind
    the kernels, once per process; whether the operators have their CPU implementations
    (without them, their references serve CPU tensors too)."""
    if os.environ.get(BACKEND_ENV) == "reference":  # torch everywhere
        return False
    kernels = [gemm.gemv_kernel(), state_update.kernel(), attention.kernel()]
    if any(kernel is None for kernel in kernels):
        return False
    if not library.load_torch_operators("ops.cpp"):
        return False
    addresses = [ctypes.cast(kernel, ctypes.c_void_p).value for kernel in kernels]
    torch.ops.hybridserve.bind_cpu_kernels(*addresses, gemm.GEMV_ROWS, gemm.SMALL_BATCH)
    return True


def register_packed(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """Let the C++ `packed_linear` find `packed` by `weight`'s address (the operators
    built)."""
    if build():
        torch.ops.hybridserve.register_packed(weight, packed)


# The C++ operators, registered for CPU tensors by `build()` (dispatch.KERNELS names them).
packed_linear = torch.ops.hybridserve.packed_linear.default
conv_update_ = torch.ops.hybridserve.conv_update_.default
ssm_update_ = torch.ops.hybridserve.ssm_update_.default
store_kv_ = torch.ops.hybridserve.store_kv_.default
attention_decode = torch.ops.hybridserve.attention_decode.default
