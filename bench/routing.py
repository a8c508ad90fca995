"""What one routing decision costs, and what the index holds per cached block, as the service
grows: the one-walk index (cluster/routing/prefix_index.py, with engine_loads.py choosing)
beside the design it replaced, side by side in one run.

    python bench/routing.py [--quick] [--engines 16 128 1024] [--prompt-tokens 1024 8192 32768]
                            [--block-size 16] [--rounds 5] [--output bench/results/routing.json]

The workload (no Ray, no model: the router's own work): every engine holds a shared system
prompt of half the prompt length and four conversations of its own (system prompt + a tail of
the other half), with a snapshot where the system prompt ends and at each conversation's
end; each decision routes a new prompt, the system prompt plus a new half, snapshot-aware, over
the engines as decode engines, colocated (so every engine is scored and chosen among). Both
designs are fed the same cache events and must give the same route.

- before (`PerEngineScan`): one prefix tree per engine, by key; a decision walks every engine's
  tree along the prompt (one lookup's keys shared by all), then scores every engine's reuse
  minus its load. A decision costs O(engines x prompt blocks).
- after: the one-walk index and the load groups, with the prompt's chain hashed beforehand (at
  the ingress, in the service): O(prompt blocks + engines that match).

Times are the best of `--rounds`, the two designs taking turns; decisions/s is one router's
rate at that cost. Memory: Python heap per cached block (tracemalloc, over building the
index), per block an engine holds and per distinct key.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
import tracemalloc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridserve.bench.common import machine, write_result
from hybridserve.cluster.routing.engine_loads import EngineLoads
from hybridserve.cluster.routing.prefix_index import PrefixIndex, prompt_chain
from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    CacheEvent,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import BlockHash, block_hash, root_hash
from hybridserve.workers.cache.prefix_tree import MAX_SCANNED_CHILDREN

CONVERSATIONS = 4
LOAD_COST_TOKENS = 128  # RouterConfig's default


@dataclass(slots=True)
class _Node:
    parent: bytes
    snapshot: tuple[int, bytes | None] | None = None  # (coverage, prefix hash or None = key)


class _Lookup:
    """One prompt's keys, computed once and shared by every engine's walk."""

    def __init__(self, tokens: Sequence[int], cache_salt: str | None, block_size: int) -> None:
        self.tokens = list(tokens)
        self.block_size = block_size
        self.root = root_hash(cache_salt)
        self._keys: dict[tuple[bytes, int, int], bytes] = {}

    def block_tokens(self, level: int) -> list[int]:
        return self.tokens[level * self.block_size : (level + 1) * self.block_size]

    def prefix_key(self, parent: bytes, level: int, num_tokens: int) -> bytes:
        memo = (parent, level, num_tokens)
        if memo not in self._keys:
            tokens = self.block_tokens(level)[:num_tokens]
            self._keys[memo] = block_hash(BlockHash(parent), tokens)
        return self._keys[memo]


@dataclass
class EngineTree:
    """One engine's prefix tree as its cache events describe it, by key."""

    block_size: int
    partial_reuse: bool = True
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    children: dict[bytes, set[bytes]] = field(default_factory=dict)

    def apply(self, event: CacheEvent) -> None:
        if isinstance(event, BlockStored):
            self.nodes[event.block_hash] = _Node(event.parent_hash)
            self.children.setdefault(event.parent_hash, set()).add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            node = self.nodes.pop(event.block_hash, None)
            if node is not None:
                siblings = self.children[node.parent]
                siblings.discard(event.block_hash)
                if not siblings:
                    del self.children[node.parent]
        elif isinstance(event, SnapshotStored):
            node = self.nodes.get(event.block_hash)
            if node is not None:
                node.snapshot = (event.coverage, event.prefix_hash)
        elif isinstance(event, SnapshotRemoved):
            node = self.nodes.get(event.block_hash)
            if node is not None and node.snapshot and node.snapshot[0] == event.coverage:
                node.snapshot = None

    def score(self, lookup: _Lookup) -> tuple[int, int]:
        """(snapshot tokens, attention tokens): the rule of `CacheCoordinator.find_reuse`,
        walked down this engine's tree alone."""
        bs = self.block_size
        parent, level = lookup.root, 0
        snapshot_tokens = attention_tokens = 0
        while level * bs < len(lookup.tokens):
            tokens = lookup.block_tokens(level)
            kids = self.children.get(parent, set())
            full = lookup.prefix_key(parent, level, bs) if len(tokens) == bs else None
            if full not in kids:
                full = None
            scan = self.partial_reuse and len(kids) < MAX_SCANNED_CHILDREN
            best = 0
            for key in kids if scan else (full,) if full is not None else ():
                snapshot = self.nodes[key].snapshot
                if snapshot is None:
                    continue
                coverage, prefix = snapshot
                if coverage <= best or coverage > len(tokens):
                    continue
                if not self.partial_reuse and coverage != bs:
                    continue
                if lookup.prefix_key(parent, level, coverage) == (prefix or key):
                    best = coverage
            if best:
                snapshot_tokens = level * bs + best
            if full is None:
                break
            attention_tokens = (level + 1) * bs
            parent, level = full, level + 1
        return snapshot_tokens, attention_tokens


class PerEngineScan:
    """The design before the one-walk index: a tree per engine, every one walked per prompt,
    then every engine scored (reuse minus load, ties round the engines). Also the tests'
    brute-force oracle for the index (tests/cluster/routing/test_prefix_index.py)."""

    def __init__(self, block_size: int, *, partial_reuse: bool = True) -> None:
        self.block_size, self.partial_reuse = block_size, partial_reuse
        self.trees: dict[str, EngineTree] = {}
        self.load: dict[str, int] = {}

    def add_engine(self, name: str) -> None:
        self.trees[name] = EngineTree(self.block_size, self.partial_reuse)
        self.load[name] = 0

    def apply(self, name: str, events: Iterable[CacheEvent]) -> None:
        for event in events:
            self.trees[name].apply(event)

    def scores(
        self, token_ids: Sequence[int], cache_salt: str | None
    ) -> dict[str, tuple[int, int]]:
        """(snapshot tokens, attention tokens) of every engine for a prompt."""
        lookup = _Lookup(token_ids[:-1], cache_salt, self.block_size)
        return {name: tree.score(lookup) for name, tree in self.trees.items()}

    def route(self, token_ids: Sequence[int], cache_salt: str | None, turn: int) -> str:
        reuse = {name: s for name, (s, _) in self.scores(token_ids, cache_salt).items()}
        order = list(self.trees)
        start = turn % len(order)
        position = {name: i for i, name in enumerate(order)}
        return max(
            order,
            key=lambda e: (
                reuse[e] - LOAD_COST_TOKENS * self.load[e],
                -((position[e] - start) % len(order)),
            ),
        )


class OneWalk:
    """The index and the load groups, as the router uses them (Router._scored, colocated)."""

    def __init__(self, block_size: int) -> None:
        self.index = PrefixIndex(block_size)
        self.loads = EngineLoads()

    def add_engine(self, name: str) -> None:
        self.loads.add(name, self.index.add_engine(name))

    def apply(self, name: str, events: Iterable[CacheEvent]) -> None:
        self.index.apply(name, events)

    def route_chain(self, prompt: Any, turn: int) -> str:
        return self.loads.best(self.index.match(prompt).snapshot, turn, LOAD_COST_TOKENS)[0]


def chain_events(
    parent: bytes, tokens: Sequence[int], block_size: int
) -> tuple[list[CacheEvent], bytes]:
    """The events of caching `tokens` under `parent` (full blocks, then a partial one), with a
    snapshot where they end; and the last full block's key."""
    events: list[CacheEvent] = []
    for start in range(0, len(tokens), block_size):
        block = tokens[start : start + block_size]
        key = block_hash(BlockHash(parent), block)
        events.append(BlockStored(key, parent, len(block)))
        if len(block) == block_size:
            parent = key
    last = events[-1]
    assert isinstance(last, BlockStored)
    events.append(SnapshotStored(last.block_hash, last.num_tokens))
    return events, parent


def workload(
    engines: int, prompt_tokens: int, block_size: int, seed: int
) -> tuple[dict[str, list[CacheEvent]], list[int]]:
    """Each engine's cache events, and the routed prompt's tokens."""
    rng = random.Random(seed)
    half = prompt_tokens // 2
    system = [rng.randrange(1, 50_000) for _ in range(half)]
    shared, system_end = chain_events(root_hash(None), system, block_size)
    per_engine = {}
    for e in range(engines):
        events = list(shared)
        for _ in range(CONVERSATIONS):
            tail = [rng.randrange(1, 50_000) for _ in range(prompt_tokens - half)]
            own, _ = chain_events(system_end, tail, block_size)
            events += own
        per_engine[f"engine-{e}"] = events
    prompt = system + [rng.randrange(1, 50_000) for _ in range(prompt_tokens - half)]
    return per_engine, prompt


def built(
    design: Callable[[], Any], events: dict[str, list[CacheEvent]], measure: bool
) -> tuple[Any, int]:
    """The design fed every engine's events, and the heap it took (0 unless `measure`)."""
    gc.collect()
    if measure:
        tracemalloc.start()
    router = design()
    for name, engine_events in events.items():
        router.add_engine(name)
        router.apply(name, engine_events)
    size = 0
    if measure:
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    return router, size


def best_ms(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(
    engines: int, prompt_tokens: int, block_size: int, rounds: int, memory: bool
) -> dict[str, Any]:
    events, prompt = workload(engines, prompt_tokens, block_size, seed=engines + prompt_tokens)
    held = sum(
        sum(isinstance(e, BlockStored) for e in engine_events) for engine_events in events.values()
    )
    before, before_bytes = built(lambda: PerEngineScan(block_size), events, memory)
    after, after_bytes = built(lambda: OneWalk(block_size), events, memory)
    stats = after.index.stats()
    assert stats.num_blocks == held
    chain = prompt_chain(prompt, None, block_size)
    hashing_ms = best_ms(lambda: prompt_chain(prompt, None, block_size), rounds)
    # The same route from both (the loads are all zero: ties go round the engines).
    for turn in (0, 1, engines - 1):
        assert before.route(prompt, None, turn) == after.route_chain(chain, turn)
    # The prompt is hashed once at the ingress; the before design hashed it in the router.
    before_ms, after_ms = float("inf"), float("inf")
    for _ in range(rounds):
        before_ms = min(before_ms, best_ms(lambda: before.route(prompt, None, 3), 1))
        after_ms = min(after_ms, best_ms(lambda: after.route_chain(chain, 3), 20))
    row = {
        "engines": engines,
        "prompt_tokens": prompt_tokens,
        "blocks_held": held,
        "distinct_blocks": stats.num_keys,
        "before_ms": round(before_ms, 4),
        "after_ms": round(after_ms, 4),
        "speedup": round(before_ms / after_ms, 1),
        "after_decisions_per_s": round(1e3 / after_ms),
        "ingress_hashing_ms": round(hashing_ms, 3),
    }
    if memory:
        row |= {
            "before_bytes_per_held_block": round(before_bytes / held),
            "after_bytes_per_held_block": round(after_bytes / held),
            "after_bytes_per_distinct_block": round(after_bytes / stats.num_keys),
            "after_heap_mb": round(after_bytes / 2**20, 1),
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 and 64 engines, short prompts")
    parser.add_argument("--engines", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--memory-up-to",
        type=int,
        default=4_000_000,
        help="measure heap (tracemalloc, slow) where engines x prompt tokens is at most this",
    )
    parser.add_argument("--output", default="bench/results/routing.json")
    args = parser.parse_args()
    if args.quick:
        args.engines, args.prompt_tokens, args.rounds = [16, 64], [256, 1024], 2
    rows = []
    print(
        f"{'engines':>7} {'prompt':>7} {'blocks held':>11} {'before ms':>10} {'after ms':>9} "
        f"{'speedup':>8} {'after/s':>8} {'B/block before':>15} {'B/block after':>14}"
    )
    for engines in args.engines:
        for tokens in args.prompt_tokens:
            memory = engines * tokens <= args.memory_up_to
            row = measure(engines, tokens, args.block_size, args.rounds, memory)
            rows.append(row)
            print(
                f"{engines:>7} {tokens:>7} {row['blocks_held']:>11} {row['before_ms']:>10.3f} "
                f"{row['after_ms']:>9.4f} {row['speedup']:>7.1f}x "
                f"{row['after_decisions_per_s']:>8} "
                f"{row.get('before_bytes_per_held_block', '-'):>15} "
                f"{row.get('after_bytes_per_held_block', '-'):>14}",
                flush=True,
            )
    write_result(
        args.output,
        {
            "benchmark": "routing",
            "machine": machine() | {"cpus": os.cpu_count()},
            "block_size": args.block_size,
            "conversations_per_engine": CONVERSATIONS,
            "load_cost_tokens": LOAD_COST_TOKENS,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
