"""One real local Ray cluster and one running service per test session (started lazily, by
the first test that asks for it), and the helpers of the tests that use them. A plugin of the
root conftest, so that tests/cluster and tests/soak share the one session service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import ray

from hybridserve.workers import LLM, SamplingParams

API_KEY, OTHER_KEY = "key-tenant-a", "key-tenant-b"
PROMPT = "The hybrid model reads this prompt and continues it for a while."
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
    "max_queued_requests": 16,  # the soak's bursts go over it
}


# Speculative decoding at its most eager: nearly every decode step verifies drafts (n-gram
# lookup from one token) and most roll back, none pause.
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "disable_below_acceptance": 0.0,
    "disable_by_batch_size": 64,
}

# A prefill engine of one rank, two decode engines of two rank actors each (placement groups
# of two 0.5-CPU bundles) that speculate; prompts go through the prefill engine.
TP_SERVICE = {
    "num_prefill": 1,
    "num_decode": 2,
    "engine": ENGINE,
    "decode_engine": {"tensor_parallel_size": 2, "speculative_config": SPECULATIVE},
    "rank_resources": {"CPU": 0.5},
    "torch_threads": 1,
    "cpu_wait_policy": "brief",  # reaches every engine process, rank actors included
    "transfer_timeout_s": 10.0,
    "router": {"decode_prefill_threshold": 8},
}


# One colocated engine (no prefill engines): the other deployment shape, beside the P/D one.
COLOCATED_SERVICE = {
    "num_prefill": 0,
    "num_decode": 1,
    "engine": ENGINE,
    "api_keys": [API_KEY],
    "torch_threads": 1,
    "stream_interval": 3,  # streams here come 3 tokens a chunk (the other shape: 1)
    "max_engine_restarts": 0,  # its last test takes the only engine out for good
}


@dataclass
class Service:
    base_url: str
    coordinator: Any
    shape: str = "disaggregated"  # or "colocated": which engines run a prompt

    def topology(self) -> dict[str, Any]:
        return self.coordinator.topology.remote().result()

    def engines(self) -> dict[str, Any]:
        return self.topology()["engines"]


@pytest.fixture(scope="session")
def service() -> Iterator[Service]:
    from hybridserve.cluster.control import local

    # Logical CPUs: two services (Serve replicas take 1 each) and tensor-parallel bundles.
    local.connect_ray(num_cpus=8)
    try:
        base_url = local.deploy(SERVICE, port=local.free_port())
        yield Service(base_url, local.coordinator())
    finally:
        local.shutdown()


@contextmanager
def beside(service: Service, config: dict[str, Any], name: str, **fields: Any) -> Iterator[Service]:
    """Another application on the session's cluster, under /<name>: Serve's one HTTP proxy
    serves it beside the session's service; deleted afterwards."""
    from ray import serve

    from hybridserve.cluster.control import local

    url = urlsplit(service.base_url)
    try:
        base_url = local.deploy(
            config, url.hostname, url.port, name=f"hybridserve-{name}", route_prefix=f"/{name}"
        )
        yield Service(base_url, local.coordinator(f"hybridserve-{name}"), **fields)
    finally:
        serve.delete(f"hybridserve-{name}")


@pytest.fixture(scope="module")
def tp_service(service: Service) -> Iterator[Service]:
    """Tensor-parallel engines, under /tp."""
    with beside(service, TP_SERVICE, "tp") as deployed:
        yield deployed


@pytest.fixture(scope="module")
def colocated_service(service: Service) -> Iterator[Service]:
    """One colocated engine, under /colocated."""
    with beside(service, COLOCATED_SERVICE, "colocated", shape="colocated") as deployed:
        yield deployed


@pytest.fixture(params=["colocated", "disaggregated"])
def deployment(request: pytest.FixtureRequest) -> Service:
    """Each deployment shape in turn: one colocated engine, then 1 prefill + 2 decode."""
    name = "colocated_service" if request.param == "colocated" else "service"
    return request.getfixturevalue(name)


# ---- helpers for the service tests -----------------------------------------------------


def client(service: Service, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def offline_tokens(llm: LLM, prompt: Any, **params: Any) -> list[int]:
    (out,) = llm.generate([prompt], SamplingParams(**params))
    return out.token_ids


def settle(service: Service, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Wait until no engine holds a request, then every engine's integrity report."""
    deadline = time.monotonic() + timeout
    while True:
        engines = service.engines()
        reports = ray.get([h.check_integrity.remote() for h in engines.values()])
        if not any(r["busy"] for r in reports) or time.monotonic() > deadline:
            return dict(zip(engines, reports, strict=True))
        time.sleep(0.2)


IN_USE = ("kv_blocks_in_use", "state_slots_in_use", "transfers_in_flight", "handoffs_held")


def num_aborted(service: Service) -> int:
    """Live requests the service's engines have aborted so far (their stats' counter)."""
    engines = service.engines()
    return sum(
        s["num_requests_aborted"] for s in ray.get([h.stats.remote() for h in engines.values()])
    )


def assert_at_baseline(service: Service) -> None:
    """Nothing running or held on any engine: pools recounted and free, and the leak
    metrics (what /metrics exports) at 0."""
    for name, report in settle(service).items():
        assert not report["busy"], name
        assert report["num_free_blocks"] == report["num_blocks"], name
        assert report["num_free_slots"] == report["num_live_slots"], name
    engines = service.engines()
    for name, stats in zip(
        engines, ray.get([h.stats.remote() for h in engines.values()]), strict=True
    ):
        assert {key: stats[key] for key in IN_USE} == dict.fromkeys(IN_USE, 0), name
        assert stats["integrity_failures"] == 0, name
