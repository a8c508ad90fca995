"""PrefixIndex scores equal what the engine really reuses.

The oracle is the engine itself: the index, fed only by the engine's cache events, must
predict each new prompt's `num_cached_tokens` exactly, before the prompt runs.
"""

from __future__ import annotations

import random

import pytest

from hybridserve.cluster.routing.prefix_index import PrefixIndex
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from hybridserve.workers.cache.events import event_to_dict
from tests.helpers import assert_pools_at_baseline

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
BS = 16


class IndexFeed:
    """An engine's event sink that forwards to the index in wire form (dicts)."""

    def __init__(self, index: PrefixIndex, name: str) -> None:
        self.index, self.name = index, name

    def on_cache_events(self, events: list) -> None:
        self.index.apply(self.name, [event_to_dict(e) for e in events])


def indexed_engine(index: PrefixIndex, name: str = "e", **overrides) -> Engine:
    args = {
        "model": "tiny",
        "block_size": BS,
        "max_num_batched_tokens": 64,
        "snapshot_interval": 0,
        "snapshot_turn_end": False,
    } | overrides
    engine = Engine(EngineConfig(**args))
    index.add_engine(name, block_size=BS, partial_reuse=engine.config.enable_partial_reuse)
    engine.subscribe(IndexFeed(index, name))
    return engine


def run(engine: Engine, prompt: list[int], salt: str | None = None) -> int:
    request_id = engine.add_request(prompt, PARAMS, cache_salt=salt)
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                cached = out.num_cached_tokens
    assert cached is not None
    return cached


def ids(n: int, start: int) -> list[int]:
    return [(start + i) % 250 for i in range(n)]


def test_attention_match_deeper_than_the_deepest_snapshot_scores_the_snapshot():
    index = PrefixIndex()
    engine = indexed_engine(index)
    shared, first_tail, second_tail = ids(48, 1), ids(32, 100), ids(40, 180)
    run(engine, shared + first_tail)  # blocks [0, 80) and one snapshot at 80
    score = index.score(shared + second_tail, None)["e"]
    # Three full blocks match, but the only snapshot lies past the fork: nothing is usable.
    assert (score.attention_tokens, score.snapshot_tokens) == (48, 0)
    assert run(engine, shared + second_tail) == 0
    assert index.score(shared + first_tail + [7, 7], None)["e"].snapshot_tokens == 80


def test_snapshot_inside_a_block_and_salts():
    index = PrefixIndex()
    engine = indexed_engine(index)
    base = ids(41, 3)  # save-last snapshot at 41: 9 tokens into block 2
    run(engine, base, salt="tenant-a")
    longer = [*base, *ids(20, 60)]
    assert index.score(longer, "tenant-a")["e"].snapshot_tokens == 41
    assert index.score(longer, "tenant-b")["e"].snapshot_tokens == 0
    assert index.score(longer, None)["e"].snapshot_tokens == 0
    assert run(engine, longer, salt="tenant-b") == 0
    assert run(engine, longer, salt="tenant-a") == 41


def test_an_adopted_snapshot_stays_scorable():
    index = PrefixIndex()
    engine = indexed_engine(index)
    conversation = ids(70, 9)
    run(engine, conversation[:41])  # partial node of 9 tokens, snapshot at 41
    run(engine, conversation[:60])  # fills block 2: the longer node adopts the snapshot at 41
    forked = [*conversation[:41], *ids(30, 200)]
    assert index.score(forked, None)["e"].snapshot_tokens == 41
    assert run(engine, forked) == 41


WORKLOADS = {
    "interval": {"snapshot_interval": 32},
    "partial-off": {"enable_partial_reuse": False, "snapshot_interval": 32},
    "turn-end": {"snapshot_turn_end": True},
    "evicting": {
        "num_kv_blocks": 24,
        "num_state_slots": 6,
        "max_num_seqs": 2,
        "max_model_len": 192,
    },
}


@pytest.mark.parametrize("config", WORKLOADS.values(), ids=WORKLOADS.keys())
def test_random_forks_and_extensions_score_exactly_the_engines_reuse(config):
    index = PrefixIndex()
    engine = indexed_engine(index, **config)
    rng = random.Random(7)
    history: list[list[int]] = []
    for step in range(24):
        if history and rng.random() < 0.8:
            parent = rng.choice(history)
            cut = rng.randint(1, len(parent))
            prompt = parent[:cut] + [rng.randrange(250) for _ in range(rng.randint(1, 40))]
        else:
            prompt = [rng.randrange(250) for _ in range(rng.randint(5, 60))]
        prompt = prompt[:150]
        predicted = index.score(prompt, None)["e"]
        assert predicted.snapshot_tokens <= max(predicted.attention_tokens, 0) + BS
        assert run(engine, prompt) == predicted.snapshot_tokens, f"step {step}"
        history.append(prompt)
    stats = index.stats()
    assert stats.num_blocks == sum(1 for _ in engine.cache.tree.nodes())
    assert stats.num_snapshots == sum(
        1 for n in engine.cache.tree.nodes() if n.snapshot is not None
    )
    assert_pools_at_baseline(engine)  # clears the cache: the index empties with it
    assert index.stats().num_blocks == 0 and index.stats().num_snapshots == 0


def test_a_removed_engine_disappears_and_its_late_events_are_dropped():
    index = PrefixIndex()
    first = indexed_engine(index, "first")
    second = indexed_engine(index, "second")
    prompt = ids(40, 5)
    run(first, prompt)
    run(second, prompt[:20])
    extended = [*prompt, 1]
    assert {n: s.snapshot_tokens for n, s in index.score(extended, None).items()} == {
        "first": 40,
        "second": 20,
    }
    index.remove_engine("first")
    run(first, ids(33, 90))  # events of a removed engine
    assert set(index.score(extended, None)) == {"second"}
    assert index.stats().num_engines == 1
