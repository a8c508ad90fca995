"""Keyword arguments shared by the kernel launches."""

from __future__ import annotations

import torch


def strides(name: str, tensor: torch.Tensor | None, *dims: str) -> dict[str, int]:
    """`stride_{name}_{dim}` for the leading dims of `tensor`, in order, as the kernels name
    their stride parameters; all 0 for an absent optional tensor (its pointer is never read).

        strides("kc", key_cache, "b", "h", "s", "d")
        -> {"stride_kc_b": ..., "stride_kc_h": ..., "stride_kc_s": ..., "stride_kc_d": ...}
    """
    if tensor is None:
        values: tuple[int, ...] = (0,) * len(dims)
    else:
        assert len(dims) <= tensor.dim(), f"{name}: {len(dims)} dims named, {tensor.dim()} exist"
        values = tensor.stride()[: len(dims)]
    return {f"stride_{name}_{dim}": value for dim, value in zip(dims, values, strict=True)}


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input_precision for inputs of `dtype`."""
    # NOTE: fp32 inputs would default to tf32 on the tensor cores (about 1e-3 relative error);
    # ieee keeps fp32 products as accurate as the reference. Other dtypes: backend default.
    return "ieee" if dtype == torch.float32 else None
