"""Run a Triton kernel on the tests' CPU tensors: on the GPU when there is one.

The tests build their inputs on the CPU from seeded generators, often as strided views of
one pool (a layer of a slot-major state pool, K and V halves of one cache). Without a GPU the
kernel runs on them under the interpreter. With one, `on_device` moves each storage to the GPU
once, rebuilds every argument as the same view of it (same offset, sizes and strides: the
strided addressing is what the tests check), runs the kernel, copies every storage back (the
kernels write state pools in place) and returns the results on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable[..., Any])


def on_device(kernel: Fn) -> Fn:
    if not torch.cuda.is_available():
        return kernel

    @functools.wraps(kernel)
    def call(*args: Any, **kwargs: Any) -> Any:
        # storage address -> (its bytes on the CPU, a copy on the GPU)
        storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def to_gpu(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(to_gpu(v) for v in value)
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return value
            storage = value.untyped_storage()
            key = storage.data_ptr()
            if key not in storages:
                host_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
                storages[key] = (host_bytes, host_bytes.cuda())
            gpu_storage = storages[key][1].untyped_storage()
            gpu = torch.empty(0, dtype=value.dtype, device="cuda")
            return gpu.set_(gpu_storage, value.storage_offset(), value.size(), value.stride())

        def to_cpu(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(to_cpu(v) for v in value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                fields = dataclasses.fields(value)
                return dataclasses.replace(
                    value, **{f.name: to_cpu(getattr(value, f.name)) for f in fields}
                )
            return value.cpu() if isinstance(value, torch.Tensor) else value

        result = kernel(*to_gpu(args), **{k: to_gpu(v) for k, v in kwargs.items()})
        torch.cuda.synchronize()
        for host_bytes, gpu_bytes in storages.values():
            host_bytes.copy_(gpu_bytes)
        return to_cpu(result)

    return call  # type: ignore[return-value]
