"""The optional host tier: evicted blocks and snapshots survive there and come back on a hit."""

from __future__ import annotations

import logging

import pytest

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.runner.cache_memory import CacheMemory
from tests.helpers import assert_pools_at_baseline, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SMALL = {
    "block_size": 16,
    "max_num_seqs": 2,
    "num_kv_blocks": 24,
    "max_model_len": 256,
    "num_state_slots": 4,
    "snapshot_interval": 64,
}


# Speculative decoding: a checkpoint slot per running request beside the live ones.
SPECULATIVE = {
    "speculative_config": {
        "prompt_lookup_min": 1,
        "disable_below_acceptance": 0.0,
        "disable_by_batch_size": 8,
    },
    "num_state_slots": 6,
}


@pytest.mark.parametrize(
    ("tp", "options"),
    [
        (1, {}),
        (2, {}),
        (1, {"kv_cache_dtype": "fp8"}),
        (1, SPECULATIVE),
    ],
    ids=["tp1", "tp2", "fp8_kv", "speculative"],
)
def test_evicted_prefix_comes_back_from_the_host_tier(tp, options):
    """At TP 2 every rank offloads and loads its own shard, on the plan's cache ops; an FP8
    KV cache's host blocks hold its bytes; with speculative decoding the rolled-back states
    the host tier keeps are exact."""
    first, *others = random_prompts([200, 180, 190, 170], seed=3, vocab=256)
    extended = [*first, 11, 12, 13]
    small = SMALL | options
    with LLM("tiny", host_cache_bytes=64 << 20, tensor_parallel_size=tp, **small) as with_host:
        memory = with_host.engine.executor.driver.memory
        assert memory.host is not None and memory.num_host_blocks > 0
        assert with_host.engine.executor.sizes.num_host_slots > 0
        with_host.generate([first], GREEDY)
        with_host.generate(others, GREEDY)  # pushes `first` out of the small device pools
        cache = with_host.engine.cache
        assert cache.attention.host is not None and cache.recurrent.host is not None
        assert any(n.block_id is None and n.host_block_id is not None for n in cache.tree.nodes())
        (out,) = with_host.generate([extended], GREEDY)
        assert out.num_cached_tokens == 200  # its prompt-end snapshot, restored from the host
        assert memory.host.kv is not None and memory.host.kv.dtype == memory.device.kv.dtype
        # The oracle: no reuse, the same cache dtype, no speculation.
        plain = {key: value for key, value in small.items() if key not in SPECULATIVE}
        without = LLM("tiny", enable_prefix_caching=False, **plain)
        assert out.token_ids == without.generate([extended], GREEDY)[0].token_ids
        assert_pools_at_baseline(with_host.engine)
        assert cache.attention.host.ids.num_free == cache.attention.host.ids.size
        if "speculative_config" in options:
            assert with_host.engine.scheduler.speculator.stats.num_draft_tokens > 0


def test_without_a_host_tier_the_evicted_prefix_is_recomputed():
    first, *others = random_prompts([200, 180, 190, 170], seed=3, vocab=256)
    llm = LLM("tiny", **SMALL)
    llm.generate([first], GREEDY)
    llm.generate(others, GREEDY)
    (out,) = llm.generate([[*first, 11, 12, 13]], GREEDY)
    assert out.num_cached_tokens < 200
    assert_pools_at_baseline(llm.engine)


def test_a_host_tier_that_cannot_be_set_up_is_a_warning_not_a_failed_start(monkeypatch, caplog):
    def fail(self, host_bytes, counts=None):
        raise RuntimeError("cannot pin 64 MiB: memlock limit")

    monkeypatch.setattr(CacheMemory, "_allocate_host", fail)
    with caplog.at_level(logging.WARNING):
        llm = LLM("tiny", host_cache_bytes=64 << 20, **SMALL)
    assert "could not be set up" in caplog.text and "memlock" in caplog.text
    assert llm.engine.executor.driver.memory.host is None
    assert llm.engine.cache.attention.host is None
    (out,) = llm.generate([[1, 2, 3, 4]], GREEDY)
    assert len(out.token_ids) == 6
    assert_pools_at_baseline(llm.engine)
