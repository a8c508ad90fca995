"""Random multi-token-prediction layers for a test checkpoint, under the names the families'
checkpoints use: transformers' own layer classes, so a test can compose its reference of the
published architecture from them (tests/workers/models/test_mtp.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

QWEN = ("qwen3_5", "qwen3_next")  # Qwen3.5 with a dense MTP layer, Qwen3-Next with a MoE one
# Engine arguments that speculate with them at their most eager.
MTP_SPECULATION = {
    "method": "mtp",
    "num_speculative_tokens": 3,
    "disable_below_acceptance": 0.0,
    "disable_by_batch_size": 64,
}


def _randomize(module: nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def add_mtp_layers(arch: str, hf_model: Any, folder: Path) -> dict[str, Any]:
    """Random MTP layers for `hf_model`, written into its checkpoint in `folder` under the
    family's names (and declared in its config.json); the modules, for the reference."""
    config = hf_model.config
    config._attn_implementation = "eager"
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(5)
    if arch in QWEN:
        if arch == "qwen3_5":
            from transformers.models.qwen3_5.modeling_qwen3_5 import (
                Qwen3_5DecoderLayer as DecoderLayer,
            )
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm
        else:
            from transformers.models.qwen3_next.modeling_qwen3_next import (
                Qwen3NextDecoderLayer as DecoderLayer,
            )
            from transformers.models.qwen3_next.modeling_qwen3_next import (
                Qwen3NextRMSNorm as Norm,
            )
        # A full-attention layer (Qwen3-Next's first one has a MoE FFN, as its MTP layer).
        full_attention = config.layer_types.index("full_attention")
        parts = {
            "enorm": Norm(hidden, config.rms_norm_eps),
            "hnorm": Norm(hidden, config.rms_norm_eps),
            "fc": nn.Linear(2 * hidden, hidden, bias=False),
            "layers": [DecoderLayer(config, full_attention)],
            "final": Norm(hidden, config.rms_norm_eps),
        }
        names = {
            "enorm": "mtp.pre_fc_norm_embedding",
            "hnorm": "mtp.pre_fc_norm_hidden",
            "fc": "mtp.fc",
            "layers": ["mtp.layers.0"],
            "final": "mtp.norm",
        }
        declared = {"mtp_num_hidden_layers" if arch == "qwen3_5" else "num_nextn_predict_layers": 1}
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import (
            NemotronHBlock,
            NemotronHRMSNorm,
        )

        kinds = config.layers_block_type
        blocks = [kinds.index("full_attention"), kinds.index("moe")]
        parts = {
            "enorm": NemotronHRMSNorm(hidden, config.layer_norm_epsilon),
            "hnorm": NemotronHRMSNorm(hidden, config.layer_norm_epsilon),
            "fc": nn.Linear(2 * hidden, hidden, bias=False),
            "layers": [NemotronHBlock(config, index) for index in blocks],
            "final": NemotronHRMSNorm(hidden, config.layer_norm_epsilon),
        }
        names = {
            "enorm": "mtp.layers.0.enorm",
            "hnorm": "mtp.layers.0.hnorm",
            "fc": "mtp.layers.0.eh_proj",
            "layers": ["mtp.layers.0", "mtp.layers.1"],
            "final": "mtp.layers.1.final_layernorm",
        }
        declared = {"mtp_hybrid_override_pattern": "*E", "num_nextn_predict_layers": 1}
    tensors = load_file(str(folder / "model.safetensors"))
    for key in ("enorm", "hnorm", "fc", "final"):
        _randomize(parts[key], generator)
        tensors[f"{names[key]}.weight"] = parts[key].weight.detach().clone()
    for layer, prefix in zip(parts["layers"], names["layers"], strict=True):
        _randomize(layer, generator)
        for name, tensor in layer.state_dict().items():
            tensors[f"{prefix}.{name}"] = tensor.detach().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | declared))
    return parts
