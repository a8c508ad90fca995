"""What the benchmark scripts share: the mid-size random checkpoint, the machine record and
the JSON result file. Imported as a sibling (`python bench/<script>.py` puts bench/ first on
sys.path)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def build_checkpoint(folder: Path, quick: bool) -> None:
    """A random NemotronH-style checkpoint (hidden 512, 12 layers `M-M*-M-M*-M-`, fp32; with
    `quick`, hidden 128) written with transformers, so both systems load the same weights."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    size = (
        dict(
            hidden_size=128,
            intermediate_size=256,
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=32,
        )
        if quick
        else dict(
            hidden_size=512,
            intermediate_size=1536,
            mamba_num_heads=16,
            mamba_head_dim=64,
            ssm_state_size=64,
        )
    )
    config = NemotronHConfig(
        vocab_size=4096,
        hybrid_override_pattern="M-M*-M-M*-M-",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        n_groups=2,
        chunk_size=128,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        time_step_min=1e-6,
        max_position_embeddings=8192,
        **size,
    )
    NemotronHForCausalLM(config).save_pretrained(folder)


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")
