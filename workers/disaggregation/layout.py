"""An engine's transferable state, as the transceiver describes it to a peer."""

from __future__ import annotations

import hashlib
import logging

from hybridserve.transceiver.layout import PeerLayout
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.executors.parallel import local_conv_sections, local_kv_heads
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.runner.model_runner import DTYPES

logger = logging.getLogger(__name__)


def peer_layout(model: HybridModelConfig, config: EngineConfig, rank: int = 0) -> PeerLayout:
    """Rank `rank`'s transferable state, as the transceiver describes it to a peer: its own
    KV heads, conv sections and SSM heads (docs/tensor-parallel.md)."""
    attention, mamba = model.attention, model.mamba
    tp = config.tensor_parallel_size
    model_id = hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:16]
    kv_heads = local_kv_heads(attention, tp) if attention else 0
    return PeerLayout(
        model_id=model_id,
        tp_size=tp,
        tp_rank=rank,
        layer_kinds=model.layer_kinds,
        kv_heads_per_layer=tuple(
            kv_heads if kind == "attention" else 0 for kind in model.layer_kinds
        ),
        num_kv_heads=attention.num_kv_heads if attention else 0,
        block_size=config.block_size,
        head_dim=attention.head_dim if attention else 0,
        kv_dtype=str(DTYPES[config.dtype]) if attention else "none",
        conv_sections=local_conv_sections(mamba, tp) if mamba else (0, 0, 0),
        mamba_groups=mamba.n_groups if mamba else 0,
        conv_width=mamba.conv_kernel - 1 if mamba else 0,
        conv_dtype=str(DTYPES[config.dtype]) if mamba else "none",
        ssm_heads=mamba.num_heads // tp if mamba else 0,
        ssm_head_dim=mamba.head_dim if mamba else 0,
        ssm_state_size=mamba.state_size if mamba else 0,
        ssm_dtype=str(DTYPES[config.mamba_ssm_dtype]) if mamba else "none",
    )
