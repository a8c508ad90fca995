"""CacheCoordinator: the scheduler's one door to the caches, over one manager per cache kind.

It answers these questions, each in one method:
- where must this request's chunks end?            `snapshot_points`
- how much of its prompt can it reuse?             `find_reuse`
- how much more once prompts in flight commit?     `reuse_in_flight`
- room for its next chunk (and the reuse itself)?  `allocate`
- what becomes reusable after this step?           `commit`
- keep / restore the state around a verify step?   `checkpoint`, `rollback`

The prefix tree is shared: a node is one block of one prefix and carries each kind's page (a
KV block for attention, at most one recurrent state snapshot). Each kind's manager owns its
pools and says, for a tree match, how deep it can reuse; the hybrid rule is their intersection:

    attention (AttentionBlockManager):    any prefix of the match   [0 ............... A]
    recurrent (RecurrentStateManager):    exact snapshot positions        s1      s2   s3
    reuse R = the deepest snapshot position <= A                            = s2 (s3 > A)

    prompt:      [ reused: R tokens              | computed from the snapshot ... | last ]
    KV blocks:   [ shared tree blocks | CoW copy ][ new private blocks ...              ]
    state:       snapshot(R) copied into the live slot, then advanced chunk by chunk

Nothing here touches a tensor: data moves are logged as ops (`ops.py`) that the scheduler puts
into the next step plan. See docs/snapshot-reuse.md for the rules and worked numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from hybridserve.workers.cache.attention import AttentionBlockManager
from hybridserve.workers.cache.events import BlockRemoved, BlockStored, CacheEvent
from hybridserve.workers.cache.ops import CacheOp, CacheOpLog, CopySlot
from hybridserve.workers.cache.prefix_tree import PrefixTree, Snapshot, TreeNode
from hybridserve.workers.cache.recurrent import RecurrentStateManager, snapshot_stored
from hybridserve.workers.core.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCachingConfig:
    enabled: bool = False
    snapshot_interval: int = 0
    save_last_snapshot: bool = True
    partial_reuse: bool = True
    offsets_from_start: tuple[int, ...] = ()
    offsets_from_end: tuple[int, ...] = ()
    # False for a model without recurrent layers: any attention match is then reusable.
    requires_snapshot: bool = True
    # Publish a finished request's prompt + output and the state after them (the next turn
    # of a conversation extends exactly that sequence).
    snapshot_turn_end: bool = False


@dataclass
class CacheStats:
    """Prefix lookups of admitted requests."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    unreused_tokens: int = 0
    aligned_hits: int = 0
    unaligned_hits: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(asdict(self).values())


@dataclass(frozen=True)
class Reuse:
    """What a request can take from the cache; side-effect free to compute."""

    num_tokens: int  # R
    nodes: tuple[TreeNode, ...]  # nodes backing blocks [0, ceil(R / block_size))
    snapshot: Snapshot | None
    attention_only_len: int  # tokens an attention-only model could reuse here
    lookup_len: int

    @staticmethod
    def none(lookup_len: int = 0) -> Reuse:
        return Reuse(0, (), None, 0, lookup_len)


@dataclass(frozen=True, slots=True)
class InFlightReuse:
    """A prompt in flight (`request`) that will commit a snapshot at `position` on another
    request's path (`CacheCoordinator.reuse_in_flight`)."""

    request: Request
    position: int


# Not frozen: one per running request per step (a frozen dataclass's __init__ sets each field
# through object.__setattr__).
@dataclass(slots=True)
class Allocation:
    """What one `allocate` call added for a request."""

    new_block_ids: list[int]
    live_slot: int
    reused_tokens: int = 0


@dataclass
class _RequestCache:
    # Tree nodes for the request's blocks 0..len-1 (reused or committed; the last may be a
    # partial node). Block i of the request's table is node i's device block, except that a
    # partial node's block is the tree's own copy.
    path: list[TreeNode] = field(default_factory=list)
    num_committed_tokens: int = 0
    # The deepest snapshot on this request's path so far (restored or committed).
    snapshot: Snapshot | None = None


class CacheCoordinator:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_live_slots: int,
        num_snapshot_slots: int = 0,
        num_checkpoint_slots: int = 0,
        prefix: PrefixCachingConfig | None = None,
        host_blocks: int = 0,
        host_slots: int = 0,
    ) -> None:
        self.prefix = prefix or PrefixCachingConfig()
        self.tree = PrefixTree(block_size)
        self.ops = CacheOpLog()
        self._events: list[CacheEvent] = []
        self.attention = AttentionBlockManager(
            num_blocks,
            block_size,
            self.ops,
            num_host_blocks=host_blocks,
            on_unbacked=self._remove_subtree,
        )
        self.recurrent = RecurrentStateManager(
            num_live_slots,
            num_snapshot_slots,
            self.ops,
            self._events,
            num_checkpoint_slots=num_checkpoint_slots,
            num_host_slots=host_slots,
        )
        self.stats = CacheStats()
        self._requests: dict[str, _RequestCache] = {}

    # ---- sizes --------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.attention.block_size

    @property
    def enabled(self) -> bool:
        return self.prefix.enabled

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones, cached ones included."""
        return self.attention.pool.num_free

    @property
    def num_free_slots(self) -> int:
        return self.recurrent.live.num_free

    # ---- 1. snapshot points ---------------------------------------------------------------

    def snapshot_points(self, request: Request) -> list[int]:
        """Sorted absolute positions at which this request's prompt must be snapshotted; the
        scheduler ends a chunk at each. Rebuilt before every scheduling pass."""
        config = self.prefix
        if not config.enabled:
            return []
        length = request.num_prompt_tokens
        points: set[int] = set()
        if config.snapshot_interval > 0:
            points.update(range(config.snapshot_interval, length + 1, config.snapshot_interval))
        if config.save_last_snapshot:
            points.add(length)
            for boundary in (request.stable_prompt_len, request.system_prompt_len):
                if boundary is not None and 0 < boundary < length:
                    points.add(boundary)
        points.update(p for p in config.offsets_from_start if 0 < p <= length)
        points.update(length - p for p in config.offsets_from_end if length - p > 0)
        return sorted(points)

    # ---- 2. reuse lookup ------------------------------------------------------------------

    def find_reuse(self, request: Request) -> Reuse:
        """The deepest position R with attention blocks for [0, R) and a snapshot at exactly R,
        R <= len - 1 (the last token is always computed). Side-effect free."""
        lookup = request.token_ids[:-1]
        if not self.prefix.enabled or request.scores_prompt:
            return Reuse.none(len(lookup))
        match = self.tree.match(lookup, request.cache_salt, partial=self.prefix.partial_reuse)
        path = tuple(b.node for b in match.blocks)
        attention_len = self.attention.longest_hit(match)
        if not self.prefix.requires_snapshot:
            beyond = match.levels[len(path) :]
            nodes = path + ((beyond[0][0].node,) if beyond else ())
            return Reuse(attention_len, nodes, None, attention_len, len(lookup))
        hit = self.recurrent.longest_hit(match, attention_len, partial=self.prefix.partial_reuse)
        if hit is None:
            return Reuse(0, (), None, attention_len, len(lookup))
        nodes = (*path[: hit.node.ordinal], hit.node)
        return Reuse(hit.position, nodes, hit.snapshot, attention_len, len(lookup))

    def reuse_in_flight(
        self, request: Request, in_flight: Iterable[Request]
    ) -> InFlightReuse | None:
        """The deepest snapshot point that a request of `in_flight` still has ahead in its
        prompt and `request` could reuse once it is committed (the two prompts agree on every
        token before it), with that request; None if none. Side-effect free.

            in flight:  | computed ....... | to compute .... P1 ....... P2 ...... |
            request:    | the same tokens ......................... | its own ... |
                                                                 ^ deepest shared point: P1
        """
        if not self.prefix.enabled or request.scores_prompt:
            return None
        lookup_len = request.num_tokens - 1
        aligned_only = not self.prefix.partial_reuse
        deepest: InFlightReuse | None = None
        for other in in_flight:
            if other.cache_salt != request.cache_salt or other.request_id not in self._requests:
                continue
            floor = max(deepest.position if deepest else 0, other.num_computed_tokens)
            for point in reversed(other.expect_snapshot_points or ()):
                if point <= floor:
                    break
                if point > lookup_len or (aligned_only and point % self.block_size):
                    continue
                if other.token_ids[:point] == request.token_ids[:point]:
                    deepest = InFlightReuse(other, point)
                    break
        return deepest

    # ---- 3. allocation --------------------------------------------------------------------

    def allocate(
        self, request: Request, num_new_tokens: int, reuse: Reuse | None = None
    ) -> Allocation | None:
        """Room for the request's next `num_new_tokens` tokens: blocks, and a live slot the
        first time. With `reuse` (first scheduling), also take the reused prefix: share its
        blocks, copy the partly used one, restore the snapshot, and move the request's cursor
        to R. All or nothing: None and no change if the pools are short."""
        request_id = request.request_id
        if reuse is not None and reuse.num_tokens > 0:
            return self._allocate_with_reuse(request, num_new_tokens, reuse)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if self.recurrent.has_slot(request_id):
            # A running request (every step of a decode): blocks only.
            new_ids = self.attention.allocate(request_id, num_tokens)
            if new_ids is None:
                return None
            return Allocation(new_ids, self.recurrent.live_slot(request_id))
        if not self.recurrent.can_allocate():
            return None
        new_ids = self.attention.allocate(request_id, num_tokens)
        if new_ids is None:
            return None
        self._requests[request_id] = _RequestCache()
        if reuse is not None and self.prefix.enabled:
            self._record_lookup(reuse, request)
        return Allocation(new_ids, self.recurrent.allocate(request_id))

    def _allocate_with_reuse(
        self, request: Request, num_new_tokens: int, reuse: Reuse
    ) -> Allocation | None:
        reused = reuse.num_tokens
        if not (
            self.recurrent.can_allocate()
            and self.attention.can_take(reuse.nodes, reused, reused + num_new_tokens)
        ):
            return None
        new_ids = self.attention.take(
            request.request_id, reuse.nodes, reused, reused + num_new_tokens
        )
        # The live slot starts as a copy of the snapshot at R.
        live_slot = self.recurrent.allocate(request.request_id)
        if reuse.snapshot is not None:
            self.recurrent.restore(reuse.snapshot, live_slot)
        request.num_computed_tokens = reused
        if request.num_preemptions == 0:
            request.num_cached_tokens = reused
        num_full = reused // self.block_size
        self._requests[request.request_id] = _RequestCache(
            list(reuse.nodes[:num_full]), reused, reuse.snapshot
        )
        self._record_lookup(reuse, request)
        return Allocation(new_ids, live_slot, reused)

    def _record_lookup(self, reuse: Reuse, request: Request) -> None:
        stats = self.stats
        stats.lookups += 1
        stats.reused_tokens += reuse.num_tokens
        stats.unreused_tokens += reuse.lookup_len - reuse.num_tokens
        if reuse.num_tokens == 0:
            stats.misses += 1
            return
        stats.hits += 1
        if reuse.num_tokens % self.block_size == 0:
            stats.aligned_hits += 1
        else:
            stats.unaligned_hits += 1
        logger.debug(
            "request %s reuses %d of %d prompt tokens",
            request.request_id,
            reuse.num_tokens,
            request.num_prompt_tokens,
        )

    def allocate_received(
        self, request: Request, block_hashes: list[bytes], num_tokens: int
    ) -> tuple[int, Allocation] | None:
        """Destination for a transferred request (decode side): share the leading full blocks
        this engine already caches (by key), allocate the rest for `num_tokens` tokens and a
        live slot. Returns (number of blocks held already, allocation), or None if short."""
        held: list[TreeNode] = []
        for node in self.tree.walk(block_hashes, request.cache_salt):
            if node.block_id is None:
                break  # only on the host: cheaper to receive it again
            held.append(node)
        if not self.recurrent.can_allocate():
            return None
        new_ids = self.attention.take_received(request.request_id, held, num_tokens)
        if new_ids is None:
            return None
        slot = self.recurrent.allocate(request.request_id)
        self._requests[request.request_id] = _RequestCache(held, len(held) * self.block_size)
        return len(held), Allocation(new_ids, slot)

    def fork(self, request: Request, child: Request) -> bool:
        """Choice `child` of an n > 1 request continues from exactly `request`'s state: the KV
        of its computed tokens (attention.fork) and a copy of its live recurrent state in a slot
        of its own, so the prompt is computed once. False (nothing held) if the pools are
        short."""
        if not self.recurrent.can_allocate():
            return False
        if not self.attention.fork(
            request.request_id, child.request_id, request.num_computed_tokens
        ):
            return False
        slot = self.recurrent.allocate(child.request_id)
        self.ops.append(CopySlot(self.recurrent.live_slot(request.request_id), slot))
        state = self._requests[request.request_id]
        self._requests[child.request_id] = _RequestCache(
            list(state.path), state.num_committed_tokens, state.snapshot
        )
        return True

    def rename(self, request_id: str, new_id: str) -> None:
        """Move everything `request_id` holds to `new_id` (e.g. a quarantine owner)."""
        self.attention.rename(request_id, new_id)
        self.recurrent.rename(request_id, new_id)
        if request_id in self._requests:
            self._requests[new_id] = self._requests.pop(request_id)

    def free_owner(self, owner: str) -> None:
        """Release what an owner that is not a request (a quarantine) holds."""
        self.attention.free(owner)
        self.recurrent.free(owner)
        self._requests.pop(owner, None)

    # ---- 4. commit ------------------------------------------------------------------------

    def commit(self, request: Request) -> None:
        """After a step advanced `request`: if it now sits on one of its snapshot points,
        publish its prompt blocks up to there and a snapshot of its live state."""
        position = request.num_computed_tokens
        if (
            not self.prefix.enabled
            or position > request.num_prompt_tokens  # points lie inside the prompt
            or request.request_id not in self._requests
        ):
            return
        state = self._requests[request.request_id]
        points = request.expect_snapshot_points or []
        limit = (
            min(max(points), request.num_prompt_tokens) if points else (request.num_prompt_tokens)
        )
        end = min(position, limit)
        if position in points and end > state.num_committed_tokens:
            self._commit_range(request, state, end)

    def commit_turn_end(self, request: Request) -> None:
        """A request finished: publish every token the model consumed and the live state
        after them, so the conversation's next turn resumes here.

            token_ids: | prompt ............ | output ......... |
            consumed:  | ................................. | last |   the last sampled
                                                           ^ snapshot   token never ran
        """
        if not (self.prefix.enabled and self.prefix.snapshot_turn_end):
            return
        state = self._requests.get(request.request_id)
        end = request.num_computed_tokens
        if state is not None and end > state.num_committed_tokens:
            self._commit_range(request, state, end)

    def _commit_range(self, request: Request, state: _RequestCache, end: int) -> None:
        bs = self.block_size
        table = self.attention.block_table(request.request_id)
        if state.path and not state.path[-1].is_full:
            state.path.pop()  # a partial node of an earlier commit: this commit extends it
        parent = state.path[-1] if state.path else self.tree.root(request.cache_salt)
        for index in range(len(state.path), -(-end // bs)):
            tokens = request.token_ids[index * bs : min((index + 1) * bs, end)]
            node = self.tree.child(parent, tokens)
            if node is None:
                node = self._insert(parent, tokens, table[index])
                if node is None:
                    return  # no block for the tree's copy: skip, only reuse is lost
            elif node.is_full:
                self.attention.share_existing(request.request_id, node, index)
            state.path.append(node)
            parent = node
        state.num_committed_tokens = end
        if self.prefix.requires_snapshot:
            live_slot = self.recurrent.live_slot(request.request_id)
            snapshot = self.recurrent.save(parent, end - parent.start, live_slot)
            if snapshot is not None:
                # NOTE: a deeper snapshot on the same path supersedes the request's previous
                # one for anything that continues this sequence (the next turn of a
                # conversation), so that one becomes the first to evict; except where its
                # system prompt ends, where the other conversations with it fork.
                previous = state.snapshot
                if previous is not None and previous.position != request.system_prompt_len:
                    self.recurrent.demote(previous)
                state.snapshot = snapshot

    def _insert(self, parent: TreeNode, tokens: list[int], own_block: int) -> TreeNode | None:
        """Register a block of a request in the tree."""
        node = self.tree.insert(parent, tokens)
        if not self.attention.cache_block(node, own_block):
            self.tree.detach(node)
            return None
        self._events.append(BlockStored(node.key, parent.key, len(tokens)))
        # A longer block replaces shorter partial siblings, adopting their snapshot when it has
        # none or a shorter one (registered first, then the sibling goes).
        for sibling in self.tree.shorter_siblings(node):
            self.recurrent.adopt(sibling, node)
            self._remove_subtree(sibling)
        return node

    # ---- 5. speculative decoding ------------------------------------------------------------

    def can_checkpoint(self, request: Request) -> bool:
        return self.recurrent.can_checkpoint(request.request_id)

    def checkpoint(self, request: Request) -> None:
        """The request verifies drafts this step: keep its live state as it is before."""
        self.recurrent.checkpoint(request.request_id)

    def rollback(self, request: Request) -> None:
        """A draft was rejected: the live state goes back to the checkpoint (the request's
        cursor goes back with it, and the accepted tokens are computed again)."""
        self.recurrent.rollback(request.request_id)

    def release_checkpoint(self, request: Request) -> None:
        """Every draft stood: the live state is exact as it is."""
        self.recurrent.release_checkpoint(request.request_id)

    # ---- release --------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self.attention.block_table(request_id)

    def live_slot(self, request_id: str) -> int:
        return self.recurrent.live_slot(request_id)

    def free(self, request: Request) -> None:
        """Release everything the request holds; its committed blocks stay cached."""
        self.attention.free(request.request_id)
        self.recurrent.free(request.request_id)
        self._requests.pop(request.request_id, None)

    def clear(self) -> None:
        """Drop every cached block and snapshot (requests keep their private blocks)."""
        for root in list(self.tree.roots.values()):
            for child in list(root.children.values()):
                self._remove_subtree(child)

    def take_events(self) -> list[CacheEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def state_events(self) -> list[CacheEvent]:
        """What the cache holds now, as the events that build it from empty (parents first):
        for a subscriber that joins late (a restarted router), before the events taken
        after this call."""
        events: list[CacheEvent] = []
        for node in sorted(self.tree.nodes(), key=lambda n: n.ordinal):
            assert node.parent is not None
            events.append(BlockStored(node.key, node.parent.key, node.num_tokens))
            if node.snapshot is not None:
                events.append(snapshot_stored(node, node.snapshot.coverage))
        return events

    def take_ops(self) -> list[CacheOp]:
        """The data moves decided since the last call, in order (for the next step plan)."""
        return self.ops.take()

    def table_update(self, request_id: str) -> tuple[int, list[int]]:
        """The part of the request's block table its next chunk carries: (from, entries)."""
        return self.attention.table_update(request_id)

    def take_released(self) -> list[str]:
        """Requests whose block tables went since the last plan (the ranks drop theirs)."""
        return self.attention.take_released()

    def _remove_subtree(self, node: TreeNode) -> None:
        """Take `node` and its descendants out of the tree, releasing every kind's pages. No
        running request holds any of them (a request holds every node on its path)."""
        for member in node.subtree():
            self.attention.release_node(member)
            self.recurrent.release_node(member)
            self._events.append(BlockRemoved(member.key))
        self.tree.detach(node)

    # ---- checks ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount every pool against its owners and the tree against its pages."""
        nodes = list(self.tree.nodes())
        problems = self.attention.check_integrity(nodes) + self.recurrent.check_integrity(nodes)
        for request_id, state in self._requests.items():
            table = self.attention.block_table(request_id)
            for index, node in enumerate(state.path):
                if node.is_full and node.block_id != table[index]:
                    problems.append(f"request {request_id} block {index} is not its path node's")
        if problems:
            raise RuntimeError("prefix cache integrity check failed: " + "; ".join(problems[:5]))
