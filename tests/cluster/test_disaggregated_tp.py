"""Prefill and decode engines of different tensor-parallel sizes, through HTTP with the
`openai` client: every rank moves its own shards (shard links between rank actors). Oracle: an
offline TP 1 engine of the same checkpoint. Topologies: prefill TP 2 -> decode TP 1, TP 1 ->
TP 2, and TP 2 -> TP 2 with expert parallelism on a MoE checkpoint, a Gated DeltaNet MoE
checkpoint (Qwen3-Next) TP 2 with expert parallelism -> TP 1 and TP 1 -> TP 2, and one
topology for each later family (OLMo-Hybrid, LFM2-MoE, Falcon-H1, Jamba, Zamba2, Kimi Linear:
every family runs P/D over both backends in tests/transceiver/test_two_processes.py); every TP
pair runs over both backends in tests/transceiver/test_shards.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.models.tiny import write_tiny_checkpoint
from tests.helpers import make_hf_model
from tests.service import ENGINE, Service, assert_at_baseline, client

pytestmark = pytest.mark.slow

APP = "hybridserve-pd-tp"
TP2 = {"tensor_parallel_size": 2}
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
TOPOLOGIES = {
    "tp2-to-tp1-tcp": ("tiny", TP2, {}, "tcp"),
    "tp1-to-tp2-nixl": ("tiny", {}, TP2, "nixl"),
    "tp2ep-to-tp2ep-nixl": ("moe", EP2, EP2, "nixl"),
    "gdn-tp2ep-to-tp1-tcp": ("gdn", EP2, {}, "tcp"),
    "gdn-tp1-to-tp2-nixl": ("gdn", {}, TP2, "nixl"),
    "olmo-tp2-to-tp1-nixl": ("olmo", TP2, {}, "nixl"),
    "lfm2moe-tp2ep-to-tp1-tcp": ("lfm2moe", EP2, {}, "tcp"),
    "falcon-tp1-to-tp2-nixl": ("falcon", {}, TP2, "nixl"),
    "jamba-tp2-to-tp1-tcp": ("jamba", TP2, {}, "tcp"),
    "zamba2-tp1-to-tp2-nixl": ("zamba2", {}, TP2, "nixl"),
    "kimi-tp2-to-tp1-nixl": ("kimi", TP2, {}, "nixl"),
}


@dataclass
class Deployment:
    service: Service
    offline: LLM
    model_id: str


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Random checkpoints with the `tiny` tokenizer, so text prompts and chat work:
    NemotronH (4 experts, a shared expert), Qwen3-Next (Gated DeltaNet, 4 experts, a gated
    shared expert), OLMo-Hybrid, LFM2-MoE, Falcon-H1, Jamba, Zamba2 and Kimi Linear."""
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tokenizer"))
    folders = {}
    families = {
        "moe": "nemotron_h",
        "gdn": "qwen3_next",
        "olmo": "olmo_hybrid",
        "lfm2moe": "lfm2_moe",
        "falcon": "falcon_h1",
        "jamba": "jamba",
        "zamba2": "zamba2",
        "kimi": "kimi_linear",
    }
    for name, arch in families.items():
        folder = tmp_path_factory.mktemp(name)
        make_hf_model(arch, vocab_size=259).save_pretrained(folder)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny / file, folder / file)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def deployment(request, service: Service, checkpoints: dict[str, str]) -> Iterator[Deployment]:
    from urllib.parse import urlsplit

    from ray import serve

    from hybridserve.cluster.control import local

    model, prefill, decode, backend = TOPOLOGIES[request.param]
    model = checkpoints.get(model, model)
    config = {
        "model": model,
        "num_prefill": 1,
        "num_decode": 1,
        "engine": ENGINE | {"transfer_backend": backend},
        "prefill_engine": prefill,
        "decode_engine": decode,
        "rank_resources": {"CPU": 0.5},
        "torch_threads": 1,
        "transfer_timeout_s": 10.0,
        # Prompts go through the prefill engine; a turn whose new part is this short is
        # prefilled by the decode engine holding the previous turn.
        "router": {"decode_prefill_threshold": 8},
    }
    url = urlsplit(service.base_url)
    try:
        base_url = local.deploy(config, url.hostname, url.port, name=APP, route_prefix="/pdtp")
        yield Deployment(
            Service(base_url, local.coordinator(APP)),
            LLM(model, **ENGINE),
            "tiny" if model == "tiny" else Path(model).name,
        )
    finally:
        serve.delete(APP)


def offline_tokens(llm: LLM, prompt: Any, **params: Any) -> list[int]:
    (out,) = llm.generate([prompt], SamplingParams(**params))
    return out.token_ids


def transfer_bytes(service: Service) -> dict[str, int]:
    engines = service.engines()
    stats = ray.get([h.stats.remote() for h in engines.values()])
    return {n: s["transfer_bytes"] for n, s in zip(engines, stats, strict=True)}


def test_requests_equal_an_offline_tp1_engine_and_turn_two_stays_on_decode(deployment):
    service, offline, model = deployment.service, deployment.offline, deployment.model_id
    api = client(service)
    prompt = [(7 * i + 3) % 250 for i in range(100)]
    extra = {"ignore_eos": True, "return_token_ids": True}
    greedy = api.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
    )
    assert greedy.choices[0].token_ids == offline_tokens(
        offline, prompt, max_tokens=12, temperature=0, ignore_eos=True
    )
    assert transfer_bytes(service)["prefill-0"] > 0  # it went through the prefill engine
    stream = api.completions.create(
        model=model,
        prompt=prompt[:70],
        max_tokens=10,
        temperature=0.9,
        seed=5,
        stream=True,
        extra_body=extra,
    )
    streamed = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
    assert streamed == offline_tokens(
        offline, prompt[:70], max_tokens=10, temperature=0.9, seed=5, ignore_eos=True
    )
    messages = [
        {"role": "system", "content": "You are a careful assistant. " * 3},
        {"role": "user", "content": "What do tensor-parallel ranks share?"},
    ]
    chat = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    (expected,) = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0))
    assert chat.choices[0].message.content == expected.text

    # Turn 2 extends turn 1 by a few tokens: the decode engine holds turn 1's snapshot
    # (received under TP, then decoded) and prefills the rest itself.
    answer = greedy.choices[0].token_ids
    second_prompt = [*prompt, *answer, 1, 2, 3]
    second = api.completions.create(
        model=model, prompt=second_prompt, max_tokens=6, temperature=0, extra_body=extra
    )
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt) + len(answer) - 1
    assert second.choices[0].token_ids == offline_tokens(
        offline, second_prompt, max_tokens=6, temperature=0, ignore_eos=True
    )
    assert_at_baseline(service)
