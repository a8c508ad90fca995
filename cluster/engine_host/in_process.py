"""The OpenAI routes' `Service` over one colocated engine in this process: what
`hybridserve run-batch` runs offline, without Ray, with the server's code for every request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from hybridserve.cluster.config import ServiceConfig
from hybridserve.cluster.engine_host.host import EngineHost
from hybridserve.cluster.messages import GenerateRequest, TokenEvent


class InProcessService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.host = EngineHost("in-process", config.engine_config("colocated"))

    async def model(self) -> dict[str, Any]:
        described = self.host.describe()
        keys = ("vocab_size", "max_model_len", "eos_token_ids")
        return {"model_id": self.config.model_id} | {k: described[k] for k in keys}

    async def healthy(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {
            "engines": {self.host.name: self.host.stats()},
            "router": {"num_blocks": 0, "num_snapshots": 0},
        }

    def events(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        return self.host.generate(request)

    def shutdown(self) -> None:
        self.host.shutdown()
