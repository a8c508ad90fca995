"""Parsing a raw config.json dict the way the loader does, for the config tests."""

from __future__ import annotations

from typing import Any

import pytest

from hybridserve.workers.models.config import ConfigError, ConfigReader, HybridModelConfig
from hybridserve.workers.models.registry import get_adapter

FILE = "ckpt/config.json"


def parse(raw: dict[str, Any]) -> HybridModelConfig:
    return get_adapter(raw.get("model_type"), FILE).parse_config(ConfigReader(raw, FILE))


def config_error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return info.value
