"""Kernels used by the layers, the models and the runner, under backend-neutral names.

Each name runs the torch reference (`reference/`, the oracle), its Triton twin (`triton/`) or
its CPU kernel (`cpu/`, C and C++ sources under cpu/csrc/) with the same signature: the
dispatch table (`dispatch.KERNELS`) lists them all, and picks per call. The decode-row kernels
that write the state pools and the GEMM on a packed weight are torch operators
(`operators`), dispatched by torch. Nothing outside this package imports its backends.
"""

from __future__ import annotations

# NOTE: absolute imports: the repository root on sys.path (tests, benchmarks) makes this folder
# importable as a top-level `kernels` too, which transformers imports; relative imports would
# then define the torch operators a second time, under that name.
from hybridserve.kernels.cpu.gemm import can_pack, pack_weight
from hybridserve.kernels.cpu.ops import build as build_cpu_operators
from hybridserve.kernels.dispatch import dispatched
from hybridserve.kernels.operators import (
    attention_decode_pooled,
    conv_update_pooled,
    gated_delta_update_pooled,
    mamba1_update_pooled,
    packed_linear,
    register_packed,
    state_update_pooled,
    store_kv_pooled,
)
from hybridserve.kernels.reference import ChunkScanOutput, Conv1dOutput, dequantize_fp8

causal_conv1d = dispatched("causal_conv1d")
causal_conv1d_update = dispatched("causal_conv1d_update")
gated_delta_chunk = dispatched("gated_delta_chunk")
gated_delta_step = dispatched("gated_delta_step")
gated_rms_norm = dispatched("gated_rms_norm")
fp8_linear = dispatched("fp8_linear")
linear = dispatched("linear")
mamba1_scan = dispatched("mamba1_scan")
mamba1_step = dispatched("mamba1_step")
mamba_chunk_scan = dispatched("mamba_chunk_scan")
paged_attention_decode = dispatched("paged_attention_decode")
paged_attention_prefill = dispatched("paged_attention_prefill")
rms_norm = dispatched("rms_norm")
selective_state_update = dispatched("selective_state_update")
store_kv = dispatched("store_kv")


__all__ = [
    "ChunkScanOutput",
    "Conv1dOutput",
    "attention_decode_pooled",
    "build_cpu_operators",
    "can_pack",
    "causal_conv1d",
    "causal_conv1d_update",
    "conv_update_pooled",
    "dequantize_fp8",
    "fp8_linear",
    "gated_delta_chunk",
    "gated_delta_step",
    "gated_delta_update_pooled",
    "gated_rms_norm",
    "linear",
    "mamba1_scan",
    "mamba1_step",
    "mamba1_update_pooled",
    "mamba_chunk_scan",
    "pack_weight",
    "packed_linear",
    "paged_attention_decode",
    "paged_attention_prefill",
    "register_packed",
    "rms_norm",
    "selective_state_update",
    "state_update_pooled",
    "store_kv",
    "store_kv_pooled",
]
