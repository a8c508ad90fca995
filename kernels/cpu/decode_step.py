"""A whole decode forward of up to eight rows on the CPU in one C call: the layers of a hybrid
model, one OpenMP team, no Python or dispatcher between ops.

At one request a decode step streams every weight once (~80 MB on the benchmark checkpoint,
2 ms here); the compiled step spends ~0.8 ms more around its ~90 kernel calls: each call goes
through the generated Python, each of its own OpenMP parallel regions wakes the team, and
after 80 MB of weights everything else runs from cold caches. This kernel runs the same
math with one parallel region for the whole step: the mat-vecs share their weight rows over
the team (each read once for every decode row), the small ops between them split by row and
channel, head or group, and the team meets at one barrier per op (3-6 per layer):

    embed -> per layer: RMSNorm -> mixer -> hidden += residual_multiplier * out -> final norm
          -> LM head (/ logits_divisor) -> each row's argmax (its greedy token)

    mamba:      in_proj -> conv update (state shifted in place) -> SSM update per head
                (`ssm_update_head`, shared with kernels/cpu/state_update.py) -> gated
                RMSNorm per group -> out_proj
    gdn:        in_proj -> conv update over q | k | v -> the delta rule per value head
                (`gated_delta_head.h`, shared with kernels/cpu/gated_delta.py) -> RMSNorm
                per value head gated by z -> out_proj
    attention:  q, k, v -> q/k norms and the output gate's split (gated attention) -> RoPE
                (optional) -> K and V written to the token's KV slot -> paged attention per
                KV head (`attend_group`, kernels/cpu/attention.py) -> gate -> o_proj
    mlp:        act(up) or act(gate) * up -> down

The model is described once (`Model`, `Layer`: weight pointers and sizes, built by
workers/runner/paths/native.py); a step (`Step`) passes each row's token, context length, block
table and state slot, and gets the logits and each row's greedy token. fp32 weights and states only.
Up to GEMV_ROWS (8) rows, as the C mat-vec (kernels/cpu/gemm.py: beyond that oneDNN's packed
GEMM catches up with it).
"""

from __future__ import annotations

import ctypes
import os

from hybridserve.kernels.cpu import library
from hybridserve.kernels.dispatch import BACKEND_ENV

KIND_MAMBA, KIND_ATTENTION, KIND_MLP, KIND_GDN, KIND_SHORT_CONV = 0, 1, 2, 3, 4
ACTIVATIONS = {None: 0, "silu": 1, "relu2": 2, "gelu": 3}
GATE_MODES = {"norm_after_gate": 0, "norm_before_gate": 1, "no_norm": 2}

_float_p = ctypes.POINTER(ctypes.c_float)


class Linear(ctypes.Structure):
    _fields_ = [("weight", _float_p), ("bias", _float_p), ("rows", ctypes.c_int64)]
    _fields_ += [("cols", ctypes.c_int64), ("fp8", ctypes.c_void_p), ("scale", _float_p)]
    _fields_ += [("group", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("cache_index", ctypes.c_int64),
        ("norm", _float_p),
        ("in_", Linear * 3),
        ("out", Linear),
        *((name, _float_p) for name in ("conv_weight", "conv_bias", "dt_bias", "A", "D")),
        ("gate_norm", _float_p),
        *((name, ctypes.c_int64) for name in ("heads", "head_dim", "groups", "state_size")),
        ("conv_kernel", ctypes.c_int64),
        ("conv_silu", ctypes.c_int64),
        *((name, ctypes.c_float) for name in ("gate_eps", "dt_min", "dt_max")),
        ("cos", _float_p),
        ("sin", _float_p),
        *((name, ctypes.c_int64) for name in ("q_heads", "kv_heads", "attention_head_dim")),
        ("rotary_dim", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("gated", ctypes.c_int64),
        ("activation", ctypes.c_int64),
        *((name, ctypes.c_int64) for name in ("key_heads", "value_heads")),
        *((name, ctypes.c_int64) for name in ("key_head_dim", "value_head_dim")),
        ("output_gate", ctypes.c_int64),
        ("q_norm", _float_p),
        ("k_norm", _float_p),
        ("qk_eps", ctypes.c_float),
        ("qk_norm_all_heads", ctypes.c_int64),
        ("post_norm", ctypes.c_int64),
        ("beta_scale", ctypes.c_float),
        ("gate_mode", ctypes.c_int64),
        ("parallel", ctypes.c_int64),
        ("keep_input", ctypes.c_int64),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden_size", ctypes.c_int64),
        ("layers", ctypes.POINTER(Layer)),
        ("embed", _float_p),
        ("final_norm", _float_p),
        ("lm_head", Linear),
        *((name, ctypes.c_float) for name in ("embedding_multiplier", "residual_multiplier")),
        *((name, ctypes.c_float) for name in ("norm_eps", "logits_divisor")),
        ("conv_pool", _float_p),
        ("conv_slot_stride", ctypes.c_int64),
        ("conv_layer_stride", ctypes.c_int64),
        ("state_pool", _float_p),
        ("state_slot_stride", ctypes.c_int64),
        ("state_layer_stride", ctypes.c_int64),
        ("kv_pool", _float_p),
        *((name, ctypes.c_int64) for name in ("kv_block_stride", "kv_layer_stride")),
        ("kv_value_offset", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        *((name, _float_p) for name in ("hidden", "normed", "projected", "mixed")),
        ("projected_size", ctypes.c_int64),
        ("mixed_size", ctypes.c_int64),
        ("layer_input", _float_p),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("lanes", ctypes.c_int64),
        ("lane_starts", ctypes.c_void_p),
    ]


_ARGTYPES = [ctypes.POINTER(Model), ctypes.POINTER(Step), *[ctypes.c_void_p] * 3]


def kernel() -> ctypes._CFuncPtr | None:
    """`decode_rows(model, step, tokens, out, greedy)`, built at first use; None
    without a compiler or with HYBRIDSERVE_KERNEL_BACKEND=reference (torch everywhere)."""
    if os.environ.get(BACKEND_ENV) == "reference":
        return None
    return library.function("decode_step.c", "decode_rows", _ARGTYPES)
