"""The global prefix index: which engines hold which KV blocks and recurrent-state snapshots.

Fed by each engine's cache events (applied in order), it holds one table keyed by block-chain
hash (the salted SHA-256 chain of `workers/cache/hashing.py`): each block with the set of
engines that hold it (a bit mask over engine slots) and, under each parent, the snapshots its
children carry, grouped by what a lookup must match to use them. Never token ids. It scores a
prompt by what a hybrid model can really reuse on each engine, the rule of
`CacheCoordinator.find_reuse`:

    lookup = prompt[:-1]                     (the last prompt token is always computed)
    blocks:    [ full ][ full ][ full ][ part.. ]
    snapshots:     S1              S3      S4?     S4 beyond the fork: not usable
    reusable = the deepest snapshot whose consumed tokens match the lookup
             <= attention match (full blocks + a matching partial node)

An attention-only router (what peers do) would score the full attention match, here 3 blocks,
and route to an engine that then reuses far less. Both numbers are reported, so a router can
choose either policy.

One walk per prompt. The prompt's chain keys are computed once, where the request is
tokenised (`PromptChain`, at the ingress); the walk follows them down the table once, carrying
the mask of engines that matched every block so far, and stops where no engine holds the next
block. At each level it looks up only the snapshot groups of the level's parent: per distinct
coverage, the key a lookup must have there (the full block, or the chain hash of the block's
first `coverage` tokens, hashed here only for a snapshot that lies inside a block) and the
engines whose snapshot has it. The cost is O(prompt blocks + matching holders), whatever the
number of engines.

An engine scans every child of a node for a partial match unless it has MAX_SCANNED_CHILDREN
or more there (prefix_tree.py); the index mirrors that per engine by counting, under a parent
with that many distinct children, each engine's children there (`_Block.fanout`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hybridserve.cluster.messages import PromptChain
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


def prompt_chain(token_ids: Sequence[int], cache_salt: str | None, block_size: int) -> PromptChain:
    """The keys a router walks for this prompt: computed once per request, at the ingress."""
    tokens = list(token_ids[:-1])
    chain = [root_hash(cache_salt)]
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chain.append(block_hash(chain[-1], tokens[start : start + block_size]))
    return PromptChain(tokens, chain, block_size)


@dataclass(frozen=True)
class ReuseScore:
    """What one engine could reuse of a prompt."""

    engine: str
    snapshot_tokens: int  # hybrid-reusable: attention blocks AND a snapshot at exactly there
    attention_tokens: int  # full attention blocks matched, whatever the snapshots


@dataclass(slots=True)
class Reuse:
    """What the engines could reuse of one prompt, as groups: (engines, tokens), `engines` a
    mask over engine slots (`PrefixIndex.add_engine`'s). An engine is in at most one group of each
    kind, and in none where it could reuse nothing."""

    snapshot: list[tuple[int, int]]  # hybrid-reusable tokens
    attention: list[tuple[int, int]]  # full attention blocks matched, in tokens


@dataclass(frozen=True)
class IndexStats:
    num_engines: int
    num_blocks: int  # summed over engines: a block two engines hold counts twice
    num_snapshots: int
    num_keys: int  # distinct blocks in the table


# A snapshot group: the engines (mask) whose snapshot lies on each node, among the snapshots
# under one parent that share a coverage and the key a lookup must match to use them.
_Owners = dict[bytes, int]


@dataclass(slots=True, eq=False)
class _Block:
    """One block key, or an anchor: a parent that is not a block (a salt's root)."""

    parent: bytes
    holders: int = 0  # bit s: the engine in slot s holds this block
    snapshot: dict[int, tuple[int, bytes | None]] | None = None  # slot -> (coverage, prefix)
    children: bytes | set[bytes] | None = None  # one child's key, or a set of them
    # Snapshots of the children: coverage -> the key a lookup must match -> node -> engines.
    snapshots: dict[int, dict[bytes, _Owners]] | None = None
    # While this has MAX_SCANNED_CHILDREN distinct children or more: each engine's count of
    # them, and the engines that have that many (they do not scan for partial matches here).
    fanout: dict[int, int] | None = None
    saturated: int = 0

    def num_children(self) -> int:
        children = self.children
        return 0 if children is None else 1 if isinstance(children, bytes) else len(children)

    def child_keys(self) -> Iterator[bytes]:
        children = self.children
        if isinstance(children, bytes):
            yield children
        elif children is not None:
            yield from children


def _slots(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Every engine's cached prefixes, in one table; scores prompts in one walk."""

    def __init__(self, block_size: int, *, partial_reuse: bool = True) -> None:
        self.block_size = block_size
        self.partial_reuse = partial_reuse
        self._blocks: dict[bytes, _Block] = {}
        self._anchors: dict[bytes, _Block] = {}
        self._slot: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []  # slots of removed engines, lowest first
        self._held: list[set[bytes]] = []  # per slot: the keys it holds
        self._num_snapshots: list[int] = []
        self._engines = 0  # mask of the engines' slots

    # ---- engines ------------------------------------------------------------------------

    def add_engine(self, name: str) -> int:
        """Start tracking an engine (empty: it has not cached anything yet; one already
        tracked starts over); returns its slot, the lowest free."""
        self.remove_engine(name)
        if self._free:
            slot = heapq.heappop(self._free)
            self._names[slot] = name
        else:
            slot = len(self._names)
            self._names.append(name)
            self._held.append(set())
            self._num_snapshots.append(0)
        self._slot[name] = slot
        self._engines |= 1 << slot
        return slot

    def remove_engine(self, name: str) -> None:
        """Forget a dead or removed engine's entries (O(what it held))."""
        slot = self._slot.pop(name, None)
        if slot is None:
            return
        for key in list(self._held[slot]):
            self._remove_block(slot, key)
        self._engines &= ~(1 << slot)
        self._names[slot] = None
        heapq.heappush(self._free, slot)
        logger.info("prefix index: dropped engine %s", name)

    # ---- events -------------------------------------------------------------------------

    def apply(self, name: str, events: Iterable[CacheEvent | dict[str, Any]]) -> None:
        """Events of one engine, in the order it emitted them (dicts from the wire, or
        event objects)."""
        slot = self._slot.get(name)
        if slot is None:
            return  # removed (dead) engine: late events are dropped
        for event in events:
            if isinstance(event, dict):
                event = event_from_dict(event)
            if isinstance(event, BlockStored):
                self._store_block(slot, event.block_hash, event.parent_hash)
            elif isinstance(event, BlockRemoved):
                self._remove_block(slot, event.block_hash)
            elif isinstance(event, SnapshotStored):
                block = self._blocks.get(event.block_hash)
                if block is not None and block.holders >> slot & 1:
                    self._drop_snapshot(slot, event.block_hash, block)
                    self._add_snapshot(slot, event, block)
            elif isinstance(event, SnapshotRemoved):
                block = self._blocks.get(event.block_hash)
                held = block.snapshot.get(slot) if block and block.snapshot else None
                if held is not None and held[0] == event.coverage:
                    self._drop_snapshot(slot, event.block_hash, block)

    def _parent(self, key: bytes) -> _Block:
        parent = self._blocks.get(key)
        if parent is None:
            parent = self._anchors.get(key)
            if parent is None:
                parent = self._anchors[key] = _Block(b"")
        return parent

    def _store_block(self, slot: int, key: bytes, parent_key: bytes) -> None:
        block = self._blocks.get(key)
        bit = 1 << slot
        if block is None:
            # A parent that lost its last holder while children remained waits as an anchor.
            block = self._anchors.pop(key, None) or _Block(parent_key)
            block.parent = parent_key
            self._blocks[key] = block
            self._add_child(self._parent(parent_key), key)
        elif block.holders & bit:
            # Stored again without a removal: a new node there, without a snapshot.
            self._drop_snapshot(slot, key, block)
            return
        block.holders |= bit
        self._held[slot].add(key)
        parent = self._parent(parent_key)
        if parent.fanout is not None:
            self._count_child(parent, slot, +1)

    def _remove_block(self, slot: int, key: bytes) -> None:
        block = self._blocks.get(key)
        bit = 1 << slot
        if block is None or not block.holders & bit:
            return
        self._drop_snapshot(slot, key, block)
        block.holders &= ~bit
        self._held[slot].discard(key)
        parent = self._parent(block.parent)
        if parent.fanout is not None:
            self._count_child(parent, slot, -1)
        if block.holders:
            return
        del self._blocks[key]
        if block.children is not None:
            self._anchors[key] = block  # its children keep their parent
        self._remove_child(parent, block.parent, key)

    def _add_child(self, parent: _Block, key: bytes) -> None:
        children = parent.children
        if children is None:
            parent.children = key
            return
        if isinstance(children, bytes):
            children = parent.children = {children}
        children.add(key)
        if len(children) == MAX_SCANNED_CHILDREN:
            fanout: dict[int, int] = {}
            for child in children:
                for holder in _slots(self._blocks[child].holders):
                    fanout[holder] = fanout.get(holder, 0) + 1
            parent.fanout = fanout
            parent.saturated = 0
            for holder, count in fanout.items():
                if count >= MAX_SCANNED_CHILDREN:
                    parent.saturated |= 1 << holder

    def _remove_child(self, parent: _Block, parent_key: bytes, key: bytes) -> None:
        children = parent.children
        if isinstance(children, bytes):
            parent.children = None
        elif children is not None:
            children.discard(key)
            if len(children) < MAX_SCANNED_CHILDREN:
                parent.fanout, parent.saturated = None, 0
            if len(children) == 1:
                parent.children = next(iter(children))
        if parent.children is None and not parent.holders:
            self._anchors.pop(parent_key, None)

    @staticmethod
    def _count_child(parent: _Block, slot: int, step: int) -> None:
        assert parent.fanout is not None
        count = parent.fanout.get(slot, 0) + step
        if count:
            parent.fanout[slot] = count
        else:
            del parent.fanout[slot]
        if count >= MAX_SCANNED_CHILDREN:
            parent.saturated |= 1 << slot
        else:
            parent.saturated &= ~(1 << slot)

    def _add_snapshot(self, slot: int, event: SnapshotStored, block: _Block) -> None:
        key = event.block_hash
        if block.snapshot is None:
            block.snapshot = {}
        block.snapshot[slot] = (event.coverage, event.prefix_hash)
        parent = self._parent(block.parent)
        if parent.snapshots is None:
            parent.snapshots = {}
        groups = parent.snapshots.setdefault(event.coverage, {})
        owners = groups.setdefault(event.prefix_hash or key, {})
        owners[key] = owners.get(key, 0) | 1 << slot
        self._num_snapshots[slot] += 1

    def _drop_snapshot(self, slot: int, key: bytes, block: _Block) -> None:
        held = block.snapshot.pop(slot, None) if block.snapshot else None
        if held is None:
            return
        if not block.snapshot:
            block.snapshot = None
        coverage, prefix = held
        parent = self._parent(block.parent)
        assert parent.snapshots is not None
        groups = parent.snapshots[coverage]
        owners = groups[prefix or key]
        owners[key] &= ~(1 << slot)
        if not owners[key]:
            del owners[key]
            if not owners:
                del groups[prefix or key]
                if not groups:
                    del parent.snapshots[coverage]
                    if not parent.snapshots:
                        parent.snapshots = None
        self._num_snapshots[slot] -= 1

    # ---- scoring ------------------------------------------------------------------------

    def match(self, prompt: PromptChain) -> Reuse:
        """What the engines could reuse of `prompt`, as groups of engines."""
        if prompt.block_size != self.block_size:
            raise ValueError(
                f"a prompt chained in blocks of {prompt.block_size} tokens cannot be looked "
                f"up in an index of {self.block_size}-token blocks"
            )
        reuse = Reuse([], [])
        bs, chain, length = self.block_size, prompt.chain, len(prompt.tokens)
        parent = self._anchors.get(chain[0])
        if parent is None:
            return reuse
        mask, matched = self._engines, 0  # the engines that matched `matched` full blocks
        while True:
            if parent.snapshots is not None and matched * bs < length:
                self._snapshots(parent, prompt, matched, mask, reuse.snapshot)
            if matched + 1 >= len(chain):
                break
            block = self._blocks.get(chain[matched + 1])
            if block is None:
                break
            held = mask & block.holders
            if matched and held != mask:
                reuse.attention.append((mask & ~held, matched * bs))
            mask = held
            if not held:
                break
            parent, matched = block, matched + 1
        if matched and mask:
            reuse.attention.append((mask, matched * bs))
        reuse.snapshot = [(engines, tokens) for engines, tokens in reuse.snapshot if engines]
        return reuse

    def scores(self, prompt: PromptChain) -> dict[str, ReuseScore]:
        """Each engine's reuse of `prompt`, engine by engine (O(engines that match): for
        diagnostics and tests; routing works on `match`'s groups). Engines that match nothing
        are left out."""
        reuse = self.match(prompt)
        per_slot: dict[int, list[int]] = {}
        for kind, groups in enumerate((reuse.snapshot, reuse.attention)):
            for engines, tokens in groups:
                for slot in _slots(engines):
                    per_slot.setdefault(slot, [0, 0])[kind] = tokens
        scores = {}
        for slot, (snapshot, attention) in per_slot.items():
            name = self._names[slot]
            assert name is not None
            scores[name] = ReuseScore(name, snapshot, attention)
        return scores

    def _snapshots(
        self,
        parent: _Block,
        prompt: PromptChain,
        level: int,
        mask: int,
        groups: list[tuple[int, int]],
    ) -> None:
        """Group the engines in `mask` by their deepest snapshot among `parent`'s children
        whose consumed tokens match block `level` of the prompt; they leave the groups of the
        shallower levels."""
        assert parent.snapshots is not None
        bs = self.block_size
        start = level * bs
        length = min(bs, len(prompt.tokens) - start)
        full = prompt.chain[level + 1] if level + 1 < len(prompt.chain) else None
        scanning = mask & ~parent.saturated if self.partial_reuse else 0
        found, shallower = 0, len(groups)
        for coverage in sorted(parent.snapshots, reverse=True):
            if coverage > length or (not self.partial_reuse and coverage != bs):
                continue
            if coverage == bs:
                key = full
            else:
                parent_key = BlockHash(prompt.chain[level])
                key = block_hash(parent_key, prompt.tokens[start : start + coverage])
            owners = parent.snapshots[coverage].get(key) if key is not None else None
            if owners is None:
                continue
            for node, engines in owners.items():
                usable = engines & (mask if node == full else scanning) & ~found
                if usable:
                    found |= usable
                    groups.append((usable, start + coverage))
        if found:
            for i in range(shallower):
                engines, tokens = groups[i]
                groups[i] = (engines & ~found, tokens)

    def stats(self) -> IndexStats:
        return IndexStats(
            num_engines=len(self._slot),
            num_blocks=sum(len(self._held[s]) for s in self._slot.values()),
            num_snapshots=sum(self._num_snapshots[s] for s in self._slot.values()),
            num_keys=len(self._blocks),
        )
