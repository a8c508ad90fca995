"""Which dtypes an engine computes and stores in, from its arguments, the checkpoint and the
device: the model dtype (`dtype`), the KV cache's (`kv_cache_dtype`) and the recurrent state
tensors' dtypes.

`dtype: auto` follows the checkpoint's `torch_dtype` on CUDA. On the CPU it is float32: the
CPU's fast paths (the native decode step, the C mat-vecs, the oneDNN-packed weights) are
float32 kernels, and a bfloat16 engine there runs on torch's generic kernels only. (An FP8
checkpoint's weights stay FP8 either way, `fp8_weights`; the dtype is what they are
dequantised into.)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.models.recurrent_state import StateRole

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_logged: set[str] = set()


def device_type(device: str) -> str:
    """What `device` of the config ("auto" included) runs on: "cpu" or "cuda"."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype a config.json declares its weights in (`torch_dtype`, newer files `dtype`;
    an image-text checkpoint's text model's own), if it is one the engine computes in."""
    for config in (raw, raw.get("text_config") or {}):
        value = config.get("torch_dtype") or config.get("dtype")
        if value in DTYPES:
            return value
    return None


def resolve_precision(config: EngineConfig, raw: dict[str, Any]) -> EngineConfig:
    """`config` with `dtype` made concrete for the checkpoint of config.json `raw` on the
    config's device (the same answer in every process of one engine)."""
    if config.dtype != "auto":
        return config
    declared = checkpoint_dtype(raw)
    if device_type(config.device) == "cuda":
        return config.model_copy(update={"dtype": declared or "bfloat16"})
    if declared not in (None, "float32"):
        _log_once(
            f"dtype auto: the checkpoint is {declared}; on the CPU the engine computes in "
            "float32 (its fast kernels are float32; set dtype to override)"
        )
    return config.model_copy(update={"dtype": "float32"})


def model_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        raise ValueError("dtype auto is resolved against the checkpoint first (resolve_precision)")
    return DTYPES[config.dtype]


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype of the attention layers' KV pool."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else model_dtype(config)


def state_dtype(config: EngineConfig, role: StateRole) -> torch.dtype:
    """The dtype of a recurrent state tensor of `role` (models/recurrent_state.py)."""
    if role == "recurrent":
        return DTYPES[config.recurrent_state_dtype]
    return DTYPES[config.conv_state_dtype] if config.conv_state_dtype else model_dtype(config)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
