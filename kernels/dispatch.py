"""Which implementation of a kernel runs: Triton or the torch reference.

Per call, from the first tensor argument:
- `HYBRIDSERVE_KERNEL_BACKEND=triton|cpu|reference` forces one backend (with
  `TRITON_INTERPRET=1` Triton also runs on the CPU, which is how its tests run without a GPU);
- otherwise Triton for CUDA tensors and `cpu` for everything else: a CPU kernel where the
  kernel has one (`CPU_KERNELS`; each falls back to the reference for inputs it does not
  take), the torch reference for the rest.
Each backend is logged once, the first time it serves a kernel. Under `torch.compile` (the
compiled decode step) the reference is traced: the compiler generates the kernel from it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hybridserve.kernels import reference

logger = logging.getLogger(__name__)

BACKEND_ENV = "HYBRIDSERVE_KERNEL_BACKEND"
BACKENDS = ("triton", "cpu", "reference")
# Public kernel name -> module of `hybridserve.kernels.triton` implementing it.
TRITON_MODULES = {
    "mamba_chunk_scan": "ssd",
    "selective_state_update": "state_update",
    "causal_conv1d": "conv1d",
    "causal_conv1d_update": "conv1d",
    "store_kv": "attention",
    "paged_attention_prefill": "attention",
    "paged_attention_decode": "attention",
    "gated_rms_norm": "norm",
}
# Public kernel name -> its CPU kernel ("module:function" under `hybridserve.kernels`).
CPU_KERNELS = {
    "mamba_chunk_scan": "cpu_scan:mamba_chunk_scan",
    "selective_state_update": "cpu_state_update:selective_state_update",
    "paged_attention_decode": "cpu_attention:paged_attention_decode",
}

Fn = TypeVar("Fn", bound=Callable[..., Any])
_logged: set[str] = set()


def kernel_backend(tensor: torch.Tensor) -> str:
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"{BACKEND_ENV}={forced!r} is not a kernel backend "
                f"(choose one of: {', '.join(BACKENDS)})"
            )
        return forced
    return "triton" if tensor.is_cuda else "cpu"


@functools.cache
def _triton_kernel(name: str) -> Callable[..., Any]:
    module = importlib.import_module(f"hybridserve.kernels.triton.{TRITON_MODULES[name]}")
    return getattr(module, name)


@functools.cache
def _cpu_kernel(name: str) -> Callable[..., Any] | None:
    if name not in CPU_KERNELS:
        return None
    module, function = CPU_KERNELS[name].split(":")
    return getattr(importlib.import_module(f"hybridserve.kernels.{module}"), function)


def dispatched(name: str) -> Callable[..., Any]:
    """The public kernel `name`: the reference `{name}_ref` or its Triton twin, per call."""
    reference_fn = getattr(reference, f"{name}_ref")

    @functools.wraps(reference_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return reference_fn(*args, **kwargs)
        backend = kernel_backend(args[0])
        if backend not in _logged:
            _logged.add(backend)
            logger.info("kernel backend: %s (first used for %s)", backend, name)
        if backend == "triton":
            kernel = _triton_kernel(name)
        elif backend == "cpu":
            kernel = _cpu_kernel(name) or reference_fn
        else:
            kernel = reference_fn
        return kernel(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call
