"""One real local Ray cluster and one running service per test session (started lazily, by
the first test that asks for it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

API_KEY, OTHER_KEY = "key-tenant-a", "key-tenant-b"
# Small pools: scenarios must return them to baseline, and the engines start fast.
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 192, "max_model_len": 768, "block_size": 16}
SERVICE = {
    "num_prefill": 1,
    "num_decode": 2,
    "engine": ENGINE,
    "api_keys": [API_KEY, OTHER_KEY],
    "tenants": {API_KEY: "tenant-a", OTHER_KEY: "tenant-b"},
    "torch_threads": 1,
    "transfer_timeout_s": 10.0,
    "router": {"decode_prefill_threshold": 64},
}


@dataclass
class Service:
    base_url: str
    coordinator: Any

    def topology(self) -> dict[str, Any]:
        return self.coordinator.topology.remote().result()

    def engines(self) -> dict[str, Any]:
        return self.topology()["engines"]


@pytest.fixture(scope="session")
def service() -> Iterator[Service]:
    from hybridserve.cluster import local

    local.connect_ray(num_cpus=4)
    try:
        base_url = local.deploy(SERVICE, port=local.free_port())
        yield Service(base_url, local.coordinator())
    finally:
        local.shutdown()
