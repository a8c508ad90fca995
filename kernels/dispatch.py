"""Which implementation of a kernel runs: the torch reference, the Triton kernel or the CPU
kernel. `KERNELS` is the table of every kernel the layers, the models and the runner call.

Per call, from the first tensor argument:
- `HYBRIDSERVE_KERNEL_BACKEND=triton|cpu|reference` forces one backend (with
  `TRITON_INTERPRET=1` Triton also runs on the CPU, which is how its tests run without a GPU);
- otherwise Triton for CUDA tensors and `cpu` for everything else: the CPU kernel where the
  kernel has one (each falls back to the reference for inputs it does not take), the torch
  reference for the rest.
Each backend is logged once, the first time it serves a kernel. Under `torch.compile` (the
compiled path) the reference is traced: the compiler generates the kernel from it.

The kernels that read or write one layer of a state pool, and the GEMM on a packed weight,
are torch operators (`operators.py`): torch's dispatcher picks their implementation, the C++
one registered for CPU tensors once it is built (cpu/ops.py), else their reference, which
calls the dispatched kernels of this table on the layer's view. The compiled path sees them
as opaque calls that write the pools in place.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

BACKEND_ENV = "HYBRIDSERVE_KERNEL_BACKEND"
BACKENDS = ("triton", "cpu", "reference")


@dataclass(frozen=True)
class Kernel:
    """A kernel's implementations, each "module:function" under `hybridserve.kernels`.
    `reference` is None only where the kernel has no torch twin of its own; its oracle is
    named beside it in the table."""

    reference: str | None
    triton: str | None = None
    cpu: str | None = None


KERNELS: dict[str, Kernel] = {
    # Mamba2: prompt chunks (scan, conv) and decode rows (state and conv updates).
    "mamba_chunk_scan": Kernel(
        "reference.ssd:mamba_chunk_scan_ref",
        "triton.ssd:mamba_chunk_scan",
        "cpu.scan:mamba_chunk_scan",
    ),
    "selective_state_update": Kernel(
        "reference.state_update:selective_state_update_ref",
        "triton.state_update:selective_state_update",
        "cpu.state_update:selective_state_update",
    ),
    "causal_conv1d": Kernel("reference.conv1d:causal_conv1d_ref", "triton.conv1d:causal_conv1d"),
    "causal_conv1d_update": Kernel(
        "reference.conv1d:causal_conv1d_update_ref", "triton.conv1d:causal_conv1d_update"
    ),
    # Mamba1 (Jamba): prompt sequences (the scan, token by token) and decode rows. The conv
    # before them is Mamba2's.
    "mamba1_scan": Kernel(
        "reference.mamba1:mamba1_scan_ref", "triton.mamba1:mamba1_scan", "cpu.mamba1:mamba1_scan"
    ),
    "mamba1_step": Kernel(
        "reference.mamba1:mamba1_step_ref", "triton.mamba1:mamba1_step", "cpu.mamba1:mamba1_step"
    ),
    # Gated DeltaNet: prompt chunks (the chunked delta rule) and decode rows (one step). The
    # short conv before them is Mamba2's (causal_conv1d, conv_update_pooled).
    "gated_delta_chunk": Kernel(
        "reference.gated_delta:gated_delta_chunk_ref",
        "triton.gated_delta:gated_delta_chunk",
        "cpu.gated_delta:gated_delta_chunk",
    ),
    "gated_delta_step": Kernel(
        "reference.gated_delta:gated_delta_step_ref",
        "triton.gated_delta:gated_delta_step",
        "cpu.gated_delta:gated_delta_step",
    ),
    # Attention over the paged KV pool.
    "store_kv": Kernel("reference.attention:store_kv_ref", "triton.attention:store_kv"),
    "paged_attention_prefill": Kernel(
        "reference.attention:paged_attention_prefill_ref",
        "triton.attention:paged_attention_prefill",
    ),
    "paged_attention_decode": Kernel(
        "reference.attention:paged_attention_decode_ref",
        "triton.attention:paged_attention_decode",
        "cpu.attention:paged_attention_decode",
    ),
    # Norms and GEMMs.
    "gated_rms_norm": Kernel("reference.norm:gated_rms_norm_ref", "triton.norm:gated_rms_norm"),
    "rms_norm": Kernel("reference.norm:rms_norm_ref"),
    "linear": Kernel("reference.linear:linear_ref", cpu="cpu.gemm:linear"),
    "fp8_linear": Kernel(
        "reference.linear:fp8_linear_ref", "triton.fp8_linear:fp8_linear", "cpu.gemm:fp8_linear"
    ),
    # Torch operators (operators.py): the reference calls the kernels above on a layer's view.
    "packed_linear": Kernel("operators:packed_linear_reference", cpu="cpu.ops:packed_linear"),
    "conv_update_pooled": Kernel("operators:conv_update_reference", cpu="cpu.ops:conv_update_"),
    "state_update_pooled": Kernel("operators:ssm_update_reference", cpu="cpu.ops:ssm_update_"),
    "gated_delta_update_pooled": Kernel("operators:gated_delta_update_reference"),
    "mamba1_update_pooled": Kernel("operators:mamba1_update_reference"),
    "store_kv_pooled": Kernel("operators:store_kv_reference", cpu="cpu.ops:store_kv_"),
    "attention_decode_pooled": Kernel(
        "operators:attention_decode_reference", cpu="cpu.ops:attention_decode"
    ),
    # CPU only. The native decode step's oracle is the model's eager step
    # (tests/workers/runner/paths/test_native.py); the mat-vecs one after another are the
    # GEMM floor the benchmarks compare a step with (bench/common.gemm_floor_ms).
    "decode_step": Kernel(None, cpu="cpu.decode_step:kernel"),
    "gemv_each": Kernel(None, cpu="cpu.gemm:gemv_each"),
}

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
def implementation(name: str, backend: str) -> Callable[..., Any] | None:
    """Kernel `name`'s implementation for `backend` (imported at first use), or None where it
    has none."""
    where = getattr(KERNELS[name], backend)
    if where is None:
        return None
    module, function = where.split(":")
    return getattr(importlib.import_module(f"hybridserve.kernels.{module}"), function)


def cpu_kernel(name: str) -> Callable[..., Any] | None:
    """A CPU-only kernel's binding (`decode_step`, `gemv_each`); None under
    `HYBRIDSERVE_KERNEL_BACKEND=reference`, which means torch everywhere."""
    if os.environ.get(BACKEND_ENV) == "reference":
        return None
    return implementation(name, "cpu")


def dispatched(name: str) -> Callable[..., Any]:
    """The public kernel `name`: its reference or its Triton or CPU twin, chosen per call."""
    reference_fn = implementation(name, "reference")
    assert reference_fn is not None, f"{name} has no reference to dispatch around"

    @functools.wraps(reference_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return reference_fn(*args, **kwargs)
        backend = kernel_backend(args[0])
        if backend not in _logged:
            _logged.add(backend)
            logger.info("kernel backend: %s (first used for %s)", backend, name)
        kernel = implementation(name, backend) or reference_fn
        return kernel(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call
