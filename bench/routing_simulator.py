"""Routing policies at cluster scale, simulated: no Ray, no model; simulated engines and the
real prefix index and router (cluster/routing) under multi-turn agent-like traffic.

    python bench/routing_simulator.py [--quick] [--engines 8 64 256 1024] [--policies ...]
                                      [--output bench/results/routing_simulator.json]

Traffic: conversations arrive as a Poisson process; each starts from one of `--system-prompts`
shared system prompts (popularity falls as 1/rank), runs a long-tailed number of turns
(geometric, mean `--mean-turns`), each turn a user message and an answer of long-tailed
lengths (lognormal), with a think time between turns. Lengths are whole blocks, so every
boundary is a block boundary.

Each simulated engine keeps a prefix cache as a hybrid engine does: KV blocks (LRU, leaves
first) and recurrent-state snapshots in fewer slots (LRU) at the system prompt's end, every
`--snapshot-interval` tokens and at each turn's end; a request reuses the deepest snapshot
whose blocks are all there. It runs prefills one at a time (0.37 ms a new prompt token, from
bench/multiturn_offline.py's no-reuse TTFT on this VM) and decodes beside them (2.2 ms a
token, bench/engine_vs_llamacpp.py at one request); TTFT is the queue wait plus the prefill.
Cache events reach the router's index `--event-delay-ms` after they happen.

Policies, each over the same traffic: `snapshot-aware` (ours), `attention-only` (peers'
prefix matching: the longest attention match, whatever the snapshots), `least-load`,
`round-robin`, and `oracle`: snapshot-aware scoring on an index that sees every cache event
at once (the index mirrors each engine's cache exactly: tests/cluster/routing). Reported per
engine count and policy: the reused fraction of prompt tokens, against the oracle's; TTFT p50
and p99; the router's own time per decision. Plots: bench/results/routing_simulator*.png.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridserve.bench.common import machine, write_result
from hybridserve.cluster.messages import PromptChain
from hybridserve.cluster.routing.prefix_index import PrefixIndex
from hybridserve.cluster.routing.router import Router, RouterConfig
from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    CacheEvent,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import root_hash

BLOCK = 16
ROOT = root_hash(None)
POLICIES = ("snapshot-aware", "attention-only", "least-load", "round-robin", "oracle")


@dataclass(frozen=True)
class Costs:
    prefill_ms_per_token: float = 0.37
    decode_ms_per_token: float = 2.2


@dataclass
class Turn:
    conversation: int
    index: int
    keys: list[bytes]  # the prompt's blocks
    answer_keys: list[bytes]
    system_blocks: int


class SimEngine:
    """One engine's prefix cache (block keys, LRU, leaves first), its snapshots (fewer
    slots, LRU) and its prefill queue."""

    def __init__(self, name: str, kv_blocks: int, snapshot_slots: int) -> None:
        self.name = name
        self.kv_blocks, self.snapshot_slots = kv_blocks, snapshot_slots
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()  # key -> parent, LRU first
        self.children: dict[bytes, int] = {}
        self.snapshots: OrderedDict[bytes, None] = OrderedDict()
        self.free_at_ms = 0.0  # when its prefill queue empties

    def reuse(self, keys: list[bytes], lookup_blocks: int) -> int:
        """Tokens reusable: the deepest snapshot (at a block's end) with every block to it."""
        reused = 0
        for level, key in enumerate(keys[:lookup_blocks]):
            if key not in self.blocks:
                break
            if key in self.snapshots:
                reused = (level + 1) * BLOCK
        return reused

    def cache(self, keys: list[bytes], snapshot_levels: set[int]) -> list[CacheEvent]:
        """Blocks `keys` (a chain from the root) and snapshots after the given blocks, touched
        as just used; what it evicted to make room. The events, in order."""
        events: list[CacheEvent] = []
        parent = ROOT
        for key in keys:
            if key not in self.blocks:
                self.blocks[key] = parent
                self.children[parent] = self.children.get(parent, 0) + 1
                events.append(BlockStored(key, parent, BLOCK))
            parent = key
        for key in reversed(keys):  # a parent is used later than its children: leaves go first
            self.blocks.move_to_end(key)
        for level in sorted(snapshot_levels):
            key = keys[level]
            if key not in self.snapshots:
                events.append(SnapshotStored(key, BLOCK))
            self.snapshots[key] = None
            self.snapshots.move_to_end(key)
        while len(self.snapshots) > self.snapshot_slots:
            key, _ = self.snapshots.popitem(last=False)
            events.append(SnapshotRemoved(key, BLOCK))
        while len(self.blocks) > self.kv_blocks:
            key = next(k for k in self.blocks if not self.children.get(k))
            parent = self.blocks.pop(key)
            self.children[parent] -= 1
            if self.snapshots.pop(key, 0) is None:
                events.append(SnapshotRemoved(key, BLOCK))
            events.append(BlockRemoved(key))
        return events


def traffic(args: argparse.Namespace, seed: int) -> list[tuple[int, list[Turn]]]:
    """Each conversation's turns (their keys and lengths); arrival times are set as the
    simulation runs (a turn follows its previous one's end by a think time)."""
    rng = random.Random(seed)
    keys = (os.urandom(32) for _ in itertools.count())
    systems = [
        [next(keys) for _ in range(max(1, round(rng.lognormvariate(math.log(64), 0.5))))]
        for _ in range(args.system_prompts)
    ]
    weights = [1 / (rank + 1) for rank in range(len(systems))]
    conversations = []
    for c in range(args.conversations):
        system = rng.choices(systems, weights)[0]
        history = list(system)
        turns = []
        count = min(args.max_turns, 1 + int(rng.expovariate(1 / max(args.mean_turns - 1, 1e-9))))
        for t in range(count):
            user = [next(keys) for _ in range(_blocks(rng, args.user_blocks))]
            answer = [next(keys) for _ in range(_blocks(rng, args.answer_blocks))]
            prompt = history + user
            turns.append(Turn(c, t, prompt, answer, len(system)))
            history = prompt + answer
        conversations.append((c, turns))
    return conversations


def _blocks(rng: random.Random, mean: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - 0.5, 1.0)))


class Simulation:
    def __init__(self, args: argparse.Namespace, engines: int, policy: str) -> None:
        self.args, self.policy = args, policy
        self.costs = Costs()
        self.engines = {
            f"engine-{i}": SimEngine(f"engine-{i}", args.kv_blocks, args.snapshot_slots)
            for i in range(engines)
        }
        router_policy = "snapshot-aware" if policy == "oracle" else policy
        self.index = PrefixIndex(BLOCK)
        self.router = Router(
            RouterConfig(policy=router_policy), self.index, [], dict.fromkeys(self.engines, 64)
        )
        self.delay_ms = 0.0 if policy == "oracle" else args.event_delay_ms
        self.route_seconds: list[float] = []
        self.ttft_ms: list[float] = []
        self.prompt_tokens = self.reused_tokens = 0

    def _route(self, turn: Turn) -> str:
        lookup_blocks = len(turn.keys) - 1  # the prompt's last token is always computed
        tokens = [0] * (len(turn.keys) * BLOCK - 1)  # only their count is read: no partial blocks
        chain = PromptChain(tokens, [ROOT, *turn.keys[:lookup_blocks]], BLOCK)
        start = time.perf_counter()
        decode = self.router.route(chain).decode
        self.route_seconds.append(time.perf_counter() - start)
        return decode

    def run(self, conversations: list[tuple[int, list[Turn]]], seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        clock = 0.0
        queue: list[tuple[float, int, Callable[[], None]]] = []
        order = itertools.count()

        def at(time_ms: float, action: Callable[[], None]) -> None:
            heapq.heappush(queue, (time_ms, next(order), action))

        def deliver(name: str, events: list[CacheEvent]) -> None:
            if events:
                at(clock + self.delay_ms, lambda: self.index.apply(name, events))

        def arrive(turns: list[Turn], index: int) -> None:
            turn = turns[index]
            name = self._route(turn)
            engine = self.engines[name]
            lookup_blocks = len(turn.keys) - 1
            reused = engine.reuse(turn.keys, lookup_blocks)
            tokens = len(turn.keys) * BLOCK
            self.prompt_tokens += tokens
            self.reused_tokens += reused
            start = max(clock, engine.free_at_ms)
            prefilled = start + (tokens - reused) * self.costs.prefill_ms_per_token
            engine.free_at_ms = prefilled
            self.ttft_ms.append(prefilled - clock)
            interval = self.args.snapshot_interval // BLOCK
            points = {turn.system_blocks - 1, len(turn.keys) - 1}
            points |= {level - 1 for level in range(interval, len(turn.keys), interval)}
            at(prefilled, lambda: deliver(name, engine.cache(turn.keys, points)))
            done = prefilled + len(turn.answer_keys) * BLOCK * self.costs.decode_ms_per_token
            history = turn.keys + turn.answer_keys

            def finish() -> None:
                deliver(name, engine.cache(history, {len(history) - 1}))
                self.router.release(name)
                if index + 1 < len(turns):
                    think = rng.expovariate(1 / self.args.think_ms)
                    at(clock + think, lambda: arrive(turns, index + 1))

            at(done, finish)

        gap = 1000.0 / self.args.rate
        arrival = 0.0
        for _, turns in conversations:
            arrival += rng.expovariate(1 / gap)
            at(arrival, lambda turns=turns: arrive(turns, 0))
        while queue:
            clock, _, action = heapq.heappop(queue)
            action()
        return {
            "requests": len(self.ttft_ms),
            "reused_fraction": self.reused_tokens / self.prompt_tokens,
            "ttft_p50_ms": statistics.median(self.ttft_ms),
            "ttft_p99_ms": statistics.quantiles(self.ttft_ms, n=100)[98],
            "route_us": statistics.median(self.route_seconds) * 1e6,
            "index_keys": self.index.stats().num_keys,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter conversations")
    parser.add_argument(
        "--engines", type=int, nargs="+", help="default: 8 64 256 1024 (--quick: 8 32)"
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--conversations-per-engine", type=float, default=12)
    parser.add_argument("--system-prompts", type=int, default=32)
    parser.add_argument("--mean-turns", type=float, default=5)
    parser.add_argument("--max-turns", type=int, default=40)
    parser.add_argument("--user-blocks", type=float, default=8, help="mean user message, blocks")
    parser.add_argument("--answer-blocks", type=float, default=6, help="mean answer, blocks")
    parser.add_argument("--think-ms", type=float, default=4000)
    parser.add_argument(
        "--load", type=float, default=0.6, help="offered prefill work over capacity, no reuse"
    )
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--snapshot-slots", type=int, default=48)
    parser.add_argument("--snapshot-interval", type=int, default=512)
    parser.add_argument("--event-delay-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench/results/routing_simulator.json")
    args = parser.parse_args()
    if args.quick:
        args.conversations_per_engine, args.mean_turns = 4, 3
    args.engines = args.engines or ([8, 32] if args.quick else [8, 64, 256, 1024])
    rows = []
    print(
        f"{'engines':>7} {'policy':>15} {'requests':>8} {'reused':>7} {'/ oracle':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'route µs':>9}"
    )
    for engines in args.engines:
        args.conversations = max(1, round(engines * args.conversations_per_engine))
        conversations = traffic(args, args.seed + engines)
        # Conversations arrive at the rate that offers `--load` of the engines' prefill
        # capacity before reuse.
        tokens = sum(len(t.keys) for _, turns in conversations for t in turns) * BLOCK
        work_ms = tokens / len(conversations) * Costs().prefill_ms_per_token
        args.rate = args.load * engines * 1000.0 / work_ms
        results = {}
        for policy in args.policies:
            results[policy] = Simulation(args, engines, policy).run(conversations, args.seed)
        oracle = results.get("oracle", {}).get("reused_fraction")
        for policy, r in results.items():
            r |= {"engines": engines, "policy": policy}
            if oracle:
                r["reuse_vs_oracle"] = r["reused_fraction"] / oracle
            rows.append(r)
            print(
                f"{engines:>7} {policy:>15} {r['requests']:>8} {r['reused_fraction']:>7.1%} "
                f"{r.get('reuse_vs_oracle', float('nan')):>8.2f} {r['ttft_p50_ms']:>8.0f}ms "
                f"{r['ttft_p99_ms']:>8.0f}ms {r['route_us']:>9.1f}",
                flush=True,
            )
    result = {
        "benchmark": "routing_simulator",
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "conversations")},
        "costs": vars(Costs()),
        "rows": rows,
    }
    write_result(args.output, result)
    plot(rows, args.output)


def plot(rows: list[dict[str, Any]], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        engines = [r["engines"] for r in mine]
        axes[0].plot(engines, [100 * r["reused_fraction"] for r in mine], marker="o", label=policy)
        axes[1].plot(engines, [r["ttft_p99_ms"] for r in mine], marker="o", label=policy)
        axes[2].plot(engines, [r["route_us"] for r in mine], marker="o", label=policy)
    for ax, title in zip(
        axes,
        ("reused prompt tokens (%)", "TTFT p99 (ms)", "router time per decision (µs)"),
        strict=True,
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines")
        ax.set_title(title)
    axes[0].legend()
    figure.tight_layout()
    path = output.removesuffix(".json") + ".png"
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
