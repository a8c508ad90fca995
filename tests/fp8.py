"""A small FP8 quantizer of the tests' own: block-wise (`quant_method: fp8`) and
compressed-tensors (per-channel, per-tensor) checkpoints in each format's file layout, written
beside the float checkpoint of their dequantised weights (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
BLOCK = (32, 48)  # rows x columns: hidden 64 and the smaller projections leave partial blocks
FORMATS = {
    "block": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)},
    "channel": "channel",
    "tensor": "tensor",
}


def compressed_tensors(strategy: str) -> dict[str, Any]:
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": scheme | {"dynamic": False},
                "input_activations": {
                    "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }  # fmt: skip


# Kept in higher precision as Qwen's FP8 releases keep them (modules_to_not_convert): Gated
# DeltaNet's small b and a projections.
UNQUANTIZED = ("in_proj_a.", "in_proj_b.", "in_proj_ba.")


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """The linear weights these checkpoints quantize: projections and experts; norms, conv,
    routers, gates, embeddings, the LM head and DeltaNet's b and a stay as they are."""
    return (
        tensor.dim() >= 2
        and name.endswith("weight")
        and ("proj" in name or ".experts." in name)
        and "conv1d" not in name
        and not any(part in name for part in UNQUANTIZED)
    )


def quantize(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as stored, the dequantised float weight q * scale)."""
    w = weight.float()
    if kind == "block":
        rows, cols = w.shape
        grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        padded = torch.zeros(grid[0] * BLOCK[0], grid[1] * BLOCK[1])
        padded[:rows, :cols] = w
        blocks = padded.reshape(grid[0], BLOCK[0], grid[1], BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # (grid)
        per_element = scale[:, None, :, None].expand_as(blocks).reshape(padded.shape)
        per_element = per_element[:rows, :cols]
    elif kind == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # (rows, 1)
        per_element = scale.expand_as(w)
    else:
        scale = w.abs().amax().clamp(min=1e-12) / E4M3_MAX  # ()
        per_element = scale.expand_as(w)
    q = (w / per_element).to(torch.float8_e4m3fn)
    return q, scale, q.float() * per_element


def write_pair(source: Path, root: Path, kind: str) -> tuple[Path, Path]:
    """The FP8 checkpoint of `source` in format `kind`, and its dequantised float twin."""
    tensors = load_file(str(source / "model.safetensors"))
    fp8_tensors, float_tensors = {}, {}
    for name, tensor in tensors.items():
        if not quantized(name, tensor):
            fp8_tensors[name] = float_tensors[name] = tensor
            continue
        q, scale, dequantised = quantize(tensor, kind)
        scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
        fp8_tensors[name] = q
        fp8_tensors[name.removesuffix("weight") + scale_name] = scale.contiguous()
        float_tensors[name] = dequantised
    config = json.loads((source / "config.json").read_text())
    quantization = FORMATS[kind] if kind == "block" else compressed_tensors(kind)
    folders = []
    for folder_name, weights, extra in (
        ("fp8", fp8_tensors, {"quantization_config": quantization}),
        ("float", float_tensors, {}),
    ):
        folder = root / f"{kind}-{folder_name}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config | extra))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        folders.append(folder)
    return folders[0], folders[1]
