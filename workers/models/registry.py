"""`model_type` (from config.json) -> the adapter that understands that checkpoint format."""

from __future__ import annotations

from hybridserve.workers.models.adapter import ArchitectureAdapter
from hybridserve.workers.models.bamba import BambaAdapter
from hybridserve.workers.models.config import ConfigError
from hybridserve.workers.models.falcon_h1 import FalconH1Adapter
from hybridserve.workers.models.granite_moe_hybrid import GraniteMoeHybridAdapter
from hybridserve.workers.models.jamba import JambaAdapter
from hybridserve.workers.models.kimi_linear import KimiLinearAdapter
from hybridserve.workers.models.lfm2 import Lfm2Adapter
from hybridserve.workers.models.nemotron_h import NemotronHAdapter
from hybridserve.workers.models.olmo_hybrid import OlmoHybridAdapter
from hybridserve.workers.models.qwen3_next import Qwen3NextAdapter
from hybridserve.workers.models.zamba2 import Zamba2Adapter

ADAPTERS: dict[str, ArchitectureAdapter] = {
    model_type: adapter
    for adapter in (
        NemotronHAdapter(),
        BambaAdapter(),
        GraniteMoeHybridAdapter(),
        Qwen3NextAdapter(),
        OlmoHybridAdapter(),
        Lfm2Adapter(),
        FalconH1Adapter(),
        JambaAdapter(),
        Zamba2Adapter(),
        KimiLinearAdapter(),
    )
    for model_type in adapter.model_types
}


def get_adapter(model_type: object, file: str) -> ArchitectureAdapter:
    if not isinstance(model_type, str) or model_type not in ADAPTERS:
        raise ConfigError(
            file,
            "model_type",
            f"unsupported model type {model_type!r} (supported: {', '.join(sorted(ADAPTERS))})",
        )
    return ADAPTERS[model_type]
