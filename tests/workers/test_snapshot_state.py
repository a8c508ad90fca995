"""A Mamba snapshot is exactly the state a fresh computation reaches at that position."""

from __future__ import annotations

import pytest
import torch

from hybridserve.workers import Engine, EngineConfig, SamplingParams
from tests.helpers import assert_pools_at_baseline, random_prompts

PROMPT = random_prompts([75], seed=5, vocab=256)[0]
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def live_state_after(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv and SSM state of a request right after its whole prompt, without any reuse."""
    engine = Engine(EngineConfig(enable_prefix_caching=False))
    request_id = engine.add_request(prompt, ONE)
    engine.step()
    slot = 0  # the only request got the lowest live slot
    assert not engine.has_unfinished_requests(), request_id
    caches = engine.caches
    return caches.state["conv"][slot].clone(), caches.state["ssm"][slot].clone()


@pytest.mark.parametrize("position", [75, 64, 48, 16])
def test_snapshot_equals_recomputed_state(position):
    engine = Engine(EngineConfig(snapshot_interval=16, save_last_snapshot=True))
    engine.add_request(PROMPT, ONE)
    while engine.has_unfinished_requests():
        engine.step()
    reuse = engine.cache.find_reuse(_probe(engine, position))
    assert reuse.num_tokens == position
    snapshot = reuse.snapshot
    assert snapshot is not None and snapshot.slot is not None
    caches = engine.caches
    conv, ssm = live_state_after(PROMPT[:position])
    assert (caches.state["conv"][snapshot.slot] - conv).abs().max() <= 1e-5
    assert (caches.state["ssm"][snapshot.slot] - ssm).abs().max() <= 1e-5
    assert_pools_at_baseline(engine)


def test_restore_copies_the_snapshot_into_the_live_slot():
    engine = Engine(EngineConfig(snapshot_interval=32))
    engine.add_request(PROMPT, ONE)
    while engine.has_unfinished_requests():
        engine.step()
    longer = [*PROMPT, 7, 8, 9]
    request = _probe(engine, len(longer) - 1, prompt=longer)
    reuse = engine.cache.find_reuse(request)
    assert reuse.num_tokens == 75 and reuse.snapshot is not None
    allocation = engine.cache.allocate(request, 3, reuse)
    assert allocation is not None and allocation.reused_tokens == 75
    caches = engine.caches
    assert torch.equal(
        caches.state["ssm"][allocation.live_slot], caches.state["ssm"][reuse.snapshot.slot]
    )
    assert torch.equal(
        caches.state["conv"][allocation.live_slot], caches.state["conv"][reuse.snapshot.slot]
    )
    engine.cache.free(request)
    assert_pools_at_baseline(engine)


def _probe(engine: Engine, position: int, prompt: list[int] | None = None):
    """A request whose lookup covers exactly `position` tokens of PROMPT (plus one to compute)."""
    from hybridserve.workers.core.request import Request

    tokens = prompt if prompt is not None else [*PROMPT[:position], 1]
    return Request(
        request_id=f"probe-{position}",
        prompt_token_ids=tokens,
        sampling_params=ONE,
        stop_token_ids=frozenset(),
        sample_seed=0,
    )
