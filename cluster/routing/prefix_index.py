"""The global prefix index: which engine holds which KV blocks and Mamba snapshots.

Fed by each engine's cache events (applied in order), it mirrors every engine's prefix tree
by key alone: the same salted SHA-256 block chain (`workers/cache/hashing.py`), parents, token
counts and snapshot coverages, never token ids. It scores a prompt per engine by what a hybrid
model can really reuse there, the rule of `CacheCoordinator.find_reuse`:

    lookup = prompt[:-1]                     (the last prompt token is always computed)
    blocks:    [ full ][ full ][ full ][ part.. ]
    snapshots:     S1              S3      S4?     S4 beyond the fork: not usable
    reusable = the deepest snapshot whose consumed tokens match the lookup
             <= attention match (full blocks + a matching partial node)

An attention-only router (what peers do) would score the full attention match, here 3 blocks,
and route to an engine that then reuses far less. Both numbers are reported, so a router can
choose either policy. The index is a plain class; a Ray actor wraps it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    CacheEvent,
    SnapshotRemoved,
    SnapshotStored,
    event_from_dict,
)
from hybridserve.workers.cache.hashing import BlockHash, block_hash, root_hash
from hybridserve.workers.cache.prefix_tree import MAX_SCANNED_CHILDREN

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReuseScore:
    """What one engine could reuse of a prompt."""

    engine: str
    snapshot_tokens: int  # hybrid-reusable: attention blocks AND a snapshot at exactly there
    attention_tokens: int  # full attention blocks matched, whatever the snapshots


@dataclass(frozen=True)
class IndexStats:
    num_engines: int
    num_blocks: int
    num_snapshots: int


@dataclass(slots=True)
class _Node:
    parent: bytes
    num_tokens: int
    snapshot: tuple[int, bytes | None] | None = None  # (coverage, prefix hash or None = key)


class _Lookup:
    """One prompt's keys, computed once and shared by every engine's view."""

    def __init__(self, token_ids: Sequence[int], cache_salt: str | None, block_size: int):
        self.tokens = list(token_ids[:-1])
        self.block_size = block_size
        self.root = root_hash(cache_salt)
        self._prefix_keys: dict[tuple[bytes, int, int], bytes] = {}

    def block_tokens(self, level: int) -> list[int]:
        start = level * self.block_size
        return self.tokens[start : start + self.block_size]

    def prefix_key(self, parent: bytes, level: int, num_tokens: int) -> bytes:
        """The chain key of the first `num_tokens` lookup tokens of block `level`."""
        memo = (parent, level, num_tokens)
        if memo not in self._prefix_keys:
            tokens = self.block_tokens(level)[:num_tokens]
            self._prefix_keys[memo] = block_hash(BlockHash(parent), tokens)
        return self._prefix_keys[memo]


@dataclass
class EngineView:
    """One engine's prefix tree, by key."""

    block_size: int
    partial_reuse: bool = True
    nodes: dict[bytes, _Node] = field(default_factory=dict)
    children: dict[bytes, set[bytes]] = field(default_factory=dict)

    def apply(self, event: CacheEvent) -> None:
        if isinstance(event, BlockStored):
            self.nodes[event.block_hash] = _Node(event.parent_hash, event.num_tokens)
            self.children.setdefault(event.parent_hash, set()).add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            node = self.nodes.pop(event.block_hash, None)
            if node is not None:
                siblings = self.children.get(node.parent)
                if siblings is not None:
                    siblings.discard(event.block_hash)
                    if not siblings:
                        del self.children[node.parent]
        elif isinstance(event, SnapshotStored):
            node = self.nodes.get(event.block_hash)
            if node is not None:
                node.snapshot = (event.coverage, event.prefix_hash)
        elif isinstance(event, SnapshotRemoved):
            node = self.nodes.get(event.block_hash)
            if (
                node is not None
                and node.snapshot is not None
                and (node.snapshot[0] == event.coverage)
            ):
                node.snapshot = None

    def score(self, name: str, lookup: _Lookup) -> ReuseScore:
        bs = self.block_size
        parent, level = lookup.root, 0
        snapshot_tokens = attention_tokens = 0
        while level * bs < len(lookup.tokens):
            tokens = lookup.block_tokens(level)
            kids = self.children.get(parent, set())
            full = lookup.prefix_key(parent, level, bs) if len(tokens) == bs else None
            if full not in kids:
                full = None
            # The engine scans every sibling for a partial match unless there are too many.
            scanned = kids if self.partial_reuse and len(kids) < MAX_SCANNED_CHILDREN else ()
            candidates = scanned or ((full,) if full is not None else ())
            best = 0
            for key in candidates:
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
        return ReuseScore(name, snapshot_tokens, attention_tokens)

    @property
    def num_snapshots(self) -> int:
        return sum(1 for node in self.nodes.values() if node.snapshot is not None)


class PrefixIndex:
    """Every engine's cached prefixes; scores prompts per engine."""

    def __init__(self) -> None:
        self.views: dict[str, EngineView] = {}

    def add_engine(self, name: str, *, block_size: int, partial_reuse: bool = True) -> None:
        """Start tracking an engine (empty: it has not cached anything yet)."""
        self.views[name] = EngineView(block_size, partial_reuse)

    def remove_engine(self, name: str) -> None:
        """Forget a dead or removed engine's entries."""
        if self.views.pop(name, None) is not None:
            logger.info("prefix index: dropped engine %s", name)

    def apply(self, name: str, events: Iterable[CacheEvent | dict[str, Any]]) -> None:
        """Events of one engine, in the order it emitted them (dicts from the wire, or
        event objects)."""
        view = self.views.get(name)
        if view is None:
            return  # removed (dead) engine: late events are dropped
        for event in events:
            view.apply(event_from_dict(event) if isinstance(event, dict) else event)

    def score(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        engines: Iterable[str] | None = None,
    ) -> dict[str, ReuseScore]:
        names = list(self.views) if engines is None else [e for e in engines if e in self.views]
        lookups: dict[int, _Lookup] = {}
        scores = {}
        for name in names:
            view = self.views[name]
            if view.block_size not in lookups:
                lookups[view.block_size] = _Lookup(token_ids, cache_salt, view.block_size)
            scores[name] = view.score(name, lookups[view.block_size])
        return scores

    def stats(self) -> IndexStats:
        return IndexStats(
            num_engines=len(self.views),
            num_blocks=sum(len(v.nodes) for v in self.views.values()),
            num_snapshots=sum(v.num_snapshots for v in self.views.values()),
        )
