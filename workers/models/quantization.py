"""Quantized checkpoints: which weight formats load, and how the engine holds their weights.

A checkpoint's `quantization_config` names its method; the loader asks `weight_format` for the
format it declares, which either refuses it (naming the method and the supported ones) or
returns the format that reads each quantized weight and its scales:

    fp8 (block-wise)             weight float8_e4m3fn (N, K), weight_scale_inv (ceil(N/bn),
                                 ceil(K/bk)): w = q * scale_inv[i // bn, j // bk]
                                 (Qwen3.5, Qwen3-Next, DeepSeek-V3: `weight_block_size`)
    compressed-tensors FP8       weight float8_e4m3fn, weight_scale per tensor () / (1,) or per
                                 output channel (N, 1): w = q * scale (Nemotron 3, Granite);
                                 a kv_cache_scheme's per-layer self_attn.k_scale / v_scale
                                 scale an FP8 KV cache (kv_cache_dtype: fp8; the loader)

Both become an `Fp8Tensor`: the bytes and a float32 scale per group of columns of each row
(a block's scale repeated over its rows; one group of all columns for per-channel and
per-tensor scales), so that fusing, stacking and sharding rows treat bytes and scales alike.
The engine keeps it so (`fp8_weights: keep`: the GEMMs of kernels/ dequantise as they read)
or dequantises it into its dtype as it loads (`dequantize`); either way tensor by tensor, and
activations are not quantised, so the engine computes what the float weights q * scale
compute. Tensors a checkpoint keeps in higher precision (norms, gates, conv, embeddings, the
LM head) load as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridserve.kernels import dequantize_fp8
from hybridserve.workers.models.config import ConfigError, WeightError

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED = (
    "fp8 with weight_block_size (block-wise FP8), compressed-tensors float-quantized FP8 "
    "(per-tensor or per-channel weight scales)"
)


class Tensors(Protocol):
    """A checkpoint's tensors by key (the loader's TensorSource)."""

    def get(self, key: str) -> torch.Tensor: ...

    def file_of(self, key: str) -> str: ...


@dataclass
class Fp8Tensor:
    """A quantized checkpoint weight as the engine holds it: float8_e4m3fn `data` (..., N, K)
    and float32 `scale` (..., N, groups), one per `group` columns of each row (the last group
    may be short). Row operations (stacking experts, fusing or scattering projections,
    sharding rows) apply to both alike; a column shard keeps whole groups."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale, self.group, dtype)


@dataclass(frozen=True)
class BlockFP8:
    """Block-wise FP8: one float32 scale per (rows, cols) block of each weight; held as
    `cols`-column groups with each block's scale repeated over its rows."""

    block: tuple[int, int]
    name = "fp8"

    def scale_keys(self, key: str) -> tuple[str, ...]:
        return (key.removesuffix("weight") + "weight_scale_inv",)

    def read(self, key: str, weight: torch.Tensor, source: Tensors) -> Fp8Tensor:
        (scale_key,) = self.scale_keys(key)
        scale = _scale(source, scale_key)
        rows, cols = weight.shape[-2:]
        block_rows, block_cols = self.block
        expected = (*weight.shape[:-2], -(-rows // block_rows), -(-cols // block_cols))
        if tuple(scale.shape) != expected:
            raise WeightError(
                source.file_of(scale_key), scale_key, f"shape {list(scale.shape)} is not the "
                f"{list(expected)} blocks of {list(self.block)} of the weight "
                f"{list(weight.shape)}"
            )  # fmt: skip
        per_row = scale.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
        return Fp8Tensor(weight, per_row.contiguous(), block_cols)


@dataclass(frozen=True)
class ScaledFP8:
    """compressed-tensors FP8: one float32 scale per tensor or per output channel; held as
    one group of all columns."""

    strategy: str  # "tensor" | "channel"
    name = "compressed-tensors"

    def scale_keys(self, key: str) -> tuple[str, ...]:
        return (key.removesuffix("weight") + "weight_scale",)

    def read(self, key: str, weight: torch.Tensor, source: Tensors) -> Fp8Tensor:
        (scale_key,) = self.scale_keys(key)
        scale = _scale(source, scale_key)
        rows, cols = weight.shape[-2:]
        per_tensor = scale.numel() == 1
        per_channel = tuple(scale.shape[-2:]) == (rows, 1) and scale.dim() == weight.dim()
        if not (per_tensor or per_channel):
            raise WeightError(
                source.file_of(scale_key), scale_key, f"shape {list(scale.shape)} is neither "
                f"one scale nor one per output channel ({rows}, 1) of the weight "
                f"{list(weight.shape)}"
            )  # fmt: skip
        per_row = scale.reshape(()).expand(*weight.shape[:-1], 1) if per_tensor else scale
        return Fp8Tensor(weight, per_row.contiguous(), cols)


WeightFormat = BlockFP8 | ScaledFP8


def weight_format(raw: dict[str, Any], file: str) -> WeightFormat | None:
    """The quantized weight format `raw` (a config.json) declares; None for a float
    checkpoint; a ConfigError naming the method (and what is supported) otherwise."""
    for field in ("compression_config", "quantization_config"):
        if raw.get(field) is not None:
            return _parse(field, raw[field], file)
    return None


def _parse(field: str, config: Any, file: str) -> WeightFormat:
    def refuse(method: object, why: str = "") -> ConfigError:
        detail = f" ({why})" if why else ""
        return ConfigError(
            file,
            field,
            f"quantization method {method!r} is not supported{detail}: float checkpoints "
            f"(float32, bfloat16, float16) load, and {SUPPORTED}",
        )

    if not isinstance(config, dict):
        raise refuse(config)
    method = config.get("quant_method") or config.get("format") or "unnamed"
    if method == "fp8":
        block = config.get("weight_block_size")
        if config.get("fmt", "e4m3") != "e4m3":
            raise refuse(method, f"fmt {config.get('fmt')!r}: only e4m3")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise refuse(method, "per-tensor fp8 without weight_block_size: only block-wise")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse(method, "static activation scales")
        return BlockFP8((block[0], block[1]))
    if method == "compressed-tensors":
        return _compressed_tensors(config, refuse)
    raise refuse(method)


def _compressed_tensors(config: dict[str, Any], refuse: Callable[..., ConfigError]) -> ScaledFP8:
    method = "compressed-tensors"
    if config.get("format") != "float-quantized":
        raise refuse(method, f"format {config.get('format')!r}: only float-quantized")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse(method, "no config_groups")
    strategies = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise refuse(method, f"config_groups.{name} has no weights scheme")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(
                method,
                f"config_groups.{name}.weights: {weights.get('type')} "
                f"{weights.get('num_bits')}-bit, only float 8-bit",
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise refuse(
                method,
                f"config_groups.{name}.weights.strategy {weights.get('strategy')!r}: only "
                "tensor or channel",
            )
        activations = group.get("input_activations")
        if isinstance(activations, dict) and not activations.get("dynamic", False):
            raise refuse(method, f"config_groups.{name}: static input activation scales")
        strategies.add(weights["strategy"])
    kv = config.get("kv_cache_scheme")
    if kv is not None and not (
        isinstance(kv, dict)
        and kv.get("type") == "float"
        and kv.get("num_bits") == 8
        and kv.get("strategy") == "tensor"
        and not kv.get("dynamic", False)
    ):
        raise refuse(method, "kv_cache_scheme: only float 8-bit static per-tensor scales")
    return ScaledFP8("channel" if "channel" in strategies else "tensor")


def _scale(source: Tensors, key: str) -> torch.Tensor:
    try:
        return source.get(key).float()
    except KeyError:
        raise WeightError("(checkpoint)", key, "missing: the FP8 weight's scales") from None


def load_weight(
    key: str, source: Tensors, fmt: WeightFormat | None, consumed: set[str]
) -> torch.Tensor | Fp8Tensor:
    """Checkpoint tensor `key`: a quantized weight with its scales (their keys added to
    `consumed`), anything else as stored."""
    tensor = source.get(key)
    if tensor.dtype not in FLOAT8:
        return tensor
    if fmt is None:
        raise WeightError(
            source.file_of(key),
            key,
            f"is {tensor.dtype}, but config.json declares no quantization_config",
        )
    consumed.update(fmt.scale_keys(key))
    return fmt.read(key, tensor, source)
