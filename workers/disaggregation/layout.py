"""An engine's transferable state, as the transceiver describes it to a peer."""

from __future__ import annotations

import hashlib

from hybridserve.transceiver.layout import PeerLayout, StateTensorLayout
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.executors.parallel import local_kv_heads
from hybridserve.workers.models.config import KV_KINDS, HybridModelConfig
from hybridserve.workers.runner.precision import kv_cache_dtype, state_dtype


def peer_layout(model: HybridModelConfig, config: EngineConfig, rank: int = 0) -> PeerLayout:
    """Rank `rank`'s transferable state, as the transceiver describes it to a peer: its own
    KV heads, and each recurrent state tensor's sections (docs/tensor-parallel.md)."""
    attention, state = model.attention, model.recurrent_state
    tp = config.tensor_parallel_size
    model_id = hashlib.sha256(model.model_dump_json().encode()).hexdigest()[:16]
    kv_heads = local_kv_heads(attention, tp) if attention else 0
    # Running MTP layers add theirs after the model's: their KV blocks move too.
    layer_kinds = model.layer_kinds
    if config.runs_mtp_layers:
        layer_kinds += model.mtp_layer_kinds * model.num_mtp_steps
    return PeerLayout(
        model_id=model_id,
        tp_size=tp,
        tp_rank=rank,
        layer_kinds=layer_kinds,
        kv_heads_per_layer=tuple(kv_heads if kind in KV_KINDS else 0 for kind in layer_kinds),
        num_kv_heads=attention.num_kv_heads if attention else 0,
        block_size=config.block_size,
        head_dim=attention.head_dim if attention else 0,
        kv_dtype=str(kv_cache_dtype(config)) if attention else "none",
        state_kind=state.kind if state else "none",
        num_state_layers=model.num_recurrent_layers,
        kv_planes=model.kv_planes,
        state_tensors=tuple(
            StateTensorLayout(
                name=tensor.name,
                dtype=str(state_dtype(config, tensor.role)),
                sections=tuple((s.size, s.units) for s in tensor.sections),
                row_shape=tensor.row_shape,
            )
            for tensor in (state.tensors if state else ())
        ),
    )
