"""PrefixIndex scores equal what the engine really reuses.

The oracle is the engine itself: the index, fed only by the engine's cache events, must
predict each new prompt's `num_cached_tokens` exactly, before the prompt runs.
"""

from __future__ import annotations

import random

import pytest

from hybridserve.bench import routing as routing_bench
from hybridserve.bench.routing import PerEngineScan
from hybridserve.cluster.routing import prefix_index
from hybridserve.cluster.routing.prefix_index import PrefixIndex, ReuseScore, prompt_chain
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    SnapshotRemoved,
    SnapshotStored,
    event_to_dict,
)
from hybridserve.workers.cache.hashing import block_hash, root_hash
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
    assert index.partial_reuse == engine.config.enable_partial_reuse
    index.add_engine(name)
    engine.subscribe(IndexFeed(index, name))
    return engine


def scores(index: PrefixIndex, prompt: list[int], salt: str | None = None) -> dict[str, ReuseScore]:
    return index.scores(prompt_chain(prompt, salt, index.block_size))


def reuse(index: PrefixIndex, prompt: list[int], salt: str | None = None) -> ReuseScore:
    """Engine e's score (the index leaves out engines that match nothing)."""
    return scores(index, prompt, salt).get("e", ReuseScore("e", 0, 0))


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
    index = PrefixIndex(BS)
    engine = indexed_engine(index)
    shared, first_tail, second_tail = ids(48, 1), ids(32, 100), ids(40, 180)
    run(engine, shared + first_tail)  # blocks [0, 80) and one snapshot at 80
    predicted = reuse(index, shared + second_tail)
    # Three full blocks match, but the only snapshot lies past the fork: nothing is usable.
    assert (predicted.attention_tokens, predicted.snapshot_tokens) == (48, 0)
    assert run(engine, shared + second_tail) == 0
    assert reuse(index, shared + first_tail + [7, 7]).snapshot_tokens == 80


def test_snapshot_inside_a_block_and_salts():
    index = PrefixIndex(BS)
    engine = indexed_engine(index)
    base = ids(41, 3)  # save-last snapshot at 41: 9 tokens into block 2
    run(engine, base, salt="tenant-a")
    longer = [*base, *ids(20, 60)]
    assert reuse(index, longer, "tenant-a").snapshot_tokens == 41
    assert reuse(index, longer, "tenant-b").snapshot_tokens == 0
    assert reuse(index, longer).snapshot_tokens == 0
    assert run(engine, longer, salt="tenant-b") == 0
    assert run(engine, longer, salt="tenant-a") == 41


def test_an_adopted_snapshot_stays_scorable():
    index = PrefixIndex(BS)
    engine = indexed_engine(index)
    conversation = ids(70, 9)
    run(engine, conversation[:41])  # partial node of 9 tokens, snapshot at 41
    run(engine, conversation[:60])  # fills block 2: the longer node adopts the snapshot at 41
    forked = [*conversation[:41], *ids(30, 200)]
    assert reuse(index, forked).snapshot_tokens == 41
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
    index = PrefixIndex(BS, partial_reuse=config.get("enable_partial_reuse", True))
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
        predicted = reuse(index, prompt)
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
    index = PrefixIndex(BS)
    first = indexed_engine(index, "first")
    second = indexed_engine(index, "second")
    prompt = ids(40, 5)
    run(first, prompt)
    run(second, prompt[:20])
    extended = [*prompt, 1]
    assert {n: s.snapshot_tokens for n, s in scores(index, extended).items()} == {
        "first": 40,
        "second": 20,
    }
    index.remove_engine("first")
    run(first, ids(33, 90))  # events of a removed engine
    assert set(scores(index, extended)) == {"second"}
    assert index.stats().num_engines == 1


# ---- the one-walk index against a scan of each engine's tree ----------------------------


class RandomEngine:
    """Draws the cache events an engine could emit: chains under two salts, leaves removed,
    snapshots stored (inside a block too, adopted by a longer one) and removed."""

    SALTS = (None, "tenant")

    def __init__(self, rng: random.Random, block_size: int, vocab: int) -> None:
        self.rng, self.bs, self.vocab = rng, block_size, vocab
        self.nodes: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # key -> (parent, tokens)
        self.snapshots: dict[bytes, int] = {}

    def events(self, paths: dict[bytes, list[int]]) -> list:
        rng, bs = self.rng, self.bs
        roll = rng.random()
        if roll < 0.45 or not self.nodes:
            full = [k for k, (_, t) in self.nodes.items() if len(t) == bs]
            parent = rng.choice(full) if full and rng.random() < 0.8 else None
            parent = parent or root_hash(rng.choice(self.SALTS))
            size = bs if rng.random() < 0.7 else rng.randint(1, bs - 1)
            tokens = tuple(rng.randrange(self.vocab) for _ in range(size))
            key = block_hash(parent, tokens)
            if key in self.nodes:  # stored again: a new node there, without a snapshot
                self.snapshots.pop(key, None)
                return [BlockStored(key, parent, size)]
            self.nodes[key] = (parent, tokens)
            paths[key] = paths.get(parent, []) + list(tokens)
            return [BlockStored(key, parent, size)]
        key = rng.choice(list(self.nodes))
        parent, tokens = self.nodes[key]
        if roll < 0.65:
            if any(p == key for p, _ in self.nodes.values()):
                return []  # an interior node goes only after its children
            del self.nodes[key]
            self.snapshots.pop(key, None)
            return [BlockRemoved(key)]
        if roll < 0.9:
            coverage = rng.randint(1, len(tokens))
            adopted = coverage < len(tokens) and rng.random() < 0.5
            prefix = block_hash(parent, tokens[:coverage]) if adopted else None
            if coverage < len(tokens) and not adopted:
                coverage = len(tokens)
            self.snapshots[key] = coverage
            return [SnapshotStored(key, coverage, prefix)]
        coverage = self.snapshots.pop(key, None)
        if coverage is None:
            coverage = rng.randint(1, bs)  # a removal that matches nothing
        return [SnapshotRemoved(key, coverage)]


@pytest.mark.parametrize("partial_reuse", [True, False], ids=["partial", "whole-blocks"])
def test_one_walk_equals_a_scan_of_every_engine_over_random_event_sequences(
    partial_reuse, monkeypatch
):
    """2,000 random event sequences over 2-6 engines (engines restarted empty among them),
    each scored against prompts drawn from what the engines hold. The oracle walks each
    engine's tree alone (the design the index replaced, kept as bench/routing.py's baseline).
    A small fan-out limit makes engines stop scanning siblings often."""
    for module in (prefix_index, routing_bench):
        monkeypatch.setattr(module, "MAX_SCANNED_CHILDREN", 3)
    rng = random.Random(11)
    bs, vocab = 3, 3
    checked = 0
    for _ in range(2000):
        names = [f"e{i}" for i in range(rng.randint(2, 6))]
        index = PrefixIndex(bs, partial_reuse=partial_reuse)
        oracle = PerEngineScan(bs, partial_reuse=partial_reuse)
        engines = {n: RandomEngine(rng, bs, vocab) for n in names}
        for name in names:
            index.add_engine(name)
            oracle.add_engine(name)
        paths: dict[bytes, list[int]] = {}
        for step in range(rng.randint(5, 40)):
            name = rng.choice(names)
            if rng.random() < 0.03:  # the engine restarts empty
                index.add_engine(name)
                oracle.add_engine(name)
                engines[name] = RandomEngine(rng, bs, vocab)
                continue
            events = engines[name].events(paths)
            index.apply(name, [event_to_dict(e) for e in events])
            oracle.apply(name, events)
            if step % 3:
                continue
            salt = rng.choice(RandomEngine.SALTS)
            held = [p for p in paths.values() if p] or [[0]]
            prompt = rng.choice(held)[: rng.randint(0, 12)]
            prompt += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            got = {
                n: (s.snapshot_tokens, s.attention_tokens)
                for n, s in index.scores(prompt_chain(prompt, salt, bs)).items()
            }
            expected = oracle.scores(prompt, salt)
            assert got == {n: s for n, s in expected.items() if s != (0, 0)}
            checked += 1
        stats = index.stats()
        trees = oracle.trees.values()
        assert stats.num_blocks == sum(len(t.nodes) for t in trees)
        assert stats.num_snapshots == sum(
            sum(n.snapshot is not None for n in t.nodes.values()) for t in trees
        )
    assert checked > 10_000
