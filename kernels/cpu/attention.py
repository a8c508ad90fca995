"""Paged attention of decode rows on the CPU, reading each key and value once: a small C kernel.

The torch reference gathers every row's blocks into one contiguous tensor, copies it again to
put heads first, and only then runs attention over it: three passes over the context's keys
and values. At 32 rows of ~700 tokens on the benchmark checkpoint that is ~70 MB of traffic
and ~3 ms of a 17 ms step. This kernel walks each row's block table and keeps a running
softmax, block by block (one pass, nothing gathered):

    for each block:   s_t = scale * q . k_t  (its tokens t);   m' = max(m, max_t s_t)
        l   = l   * exp(m - m') + sum_t exp(s_t - m')
        acc = acc * exp(m - m') + sum_t exp(s_t - m') * v_t

per row and query head; the query heads that share a KV head are done together, so each key
and value is read once for all of them. `acc / l` is the output. Rows with seq_len 0 output
zeros (the decode graphs' padding rows).

Built like the state-update kernel (`library`, ctypes); serving `paged_attention_decode`
for the eager CPU path (`dispatch.CPU_KERNELS`) and, as the operator
`hybridserve::attention_decode` (kernels/cpu/ops.py), the compiled decode step. fp32 caches only;
anything else, or no compiler, runs the reference. Tests: tests/kernels/cpu/test_attention.py.
"""

from __future__ import annotations

import ctypes

import torch

from hybridserve.kernels.cpu import library
from hybridserve.kernels.reference import paged_attention_decode_ref

_ARGTYPES = (
    [ctypes.c_void_p] * 3
    + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    + [ctypes.c_int64] * 5
    + [ctypes.c_float, ctypes.c_void_p]
)


def build() -> bool:
    """Compile (or find in the cache) and load the kernel, once per process; whether it is
    usable."""
    return kernel() is not None


def kernel() -> ctypes._CFuncPtr | None:
    return library.function("attention.c", "attention_decode_f32", _ARGTYPES)


def available(cache: torch.Tensor) -> bool:
    """Whether the kernel can read this cache: the KV pool (num_blocks, layers, 2, Hkv,
    block_size, D) or one layer's key or value view (num_blocks, Hkv, block_size, D), fp32 on
    the CPU, each block's (Hkv, block_size, D) contiguous, and the kernel built (`build`)."""
    block = cache[0, 0, 0] if cache.dim() == 6 else cache[0]
    return (
        library.loaded("attention.c", "attention_decode_f32")
        and cache.device.type == "cpu"
        and cache.dtype == torch.float32
        and block.is_contiguous()
    )


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_decode_ref` (same arguments) through the kernel where it applies."""
    usable = (
        build()
        and available(key_cache)
        and available(value_cache)
        and key_cache.stride(0) == value_cache.stride(0)
    )
    if not usable:
        return paged_attention_decode_ref(
            q, key_cache, value_cache, block_tables=block_tables, seq_lens=seq_lens, scale=scale
        )
    return _attend(q, key_cache, value_cache, block_tables, seq_lens, scale).to(q.dtype)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The kernel on (num_blocks, Hkv, block_size, D) key and value views; fp32 output."""
    run = kernel()
    assert run is not None, "the kernel before build(): check available() first"
    rows, H, D = q.shape
    Hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    q = q.contiguous().float()
    tables, lens = block_tables.contiguous().long(), seq_lens.contiguous().long()
    out = torch.empty((rows, H, D), dtype=torch.float32)
    run(
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        rows,
        H,
        Hkv,
        D,
        block_size,
        scale,
        out.data_ptr(),
    )
    return out
