"""The prefix tree: which token prefixes have KV blocks and Mamba snapshots here.

A node is one block of one prefix: up to `block_size` tokens under its parent, keyed by the
chained block hash. Interior nodes are always full; a path may end in a partial node. A node
may carry one Mamba snapshot: the state after `coverage` tokens of that block (absolute position
ordinal * block_size + coverage), and only the latest (largest) coverage is kept per node.

    ordinal:     0          1          2
    path:    [ 32 tok ] [ 32 tok ] [ 12 tok ]     snapshot on node 2, coverage 12
    position:  0 .. 31   32 .. 63   64 .. 75      = state after exactly 76 tokens

This module is the data structure only (match, insert, detach); the cache manager owns the
pools behind `block_id` / `host_block_id` and the snapshot slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hybridserve.workers.cache.hashing import BlockHash, block_hash, root_hash

# A partial match scans a node's children for the longest common token prefix; a node with
# this many children or more is not scanned (bounded lookup cost, at worst a missed reuse).
MAX_SCANNED_CHILDREN = 32


@dataclass(slots=True, eq=False)
class Snapshot:
    node: TreeNode
    coverage: int
    slot: int | None = None  # device slot in the Mamba state pool
    host_slot: int | None = None  # or its copy in the host tier

    @property
    def position(self) -> int:
        return self.node.start + self.coverage


@dataclass(slots=True, eq=False)
class TreeNode:
    key: BlockHash
    parent: TreeNode | None
    token_ids: tuple[int, ...]
    ordinal: int  # block index; the root is -1
    block_size: int
    block_id: int | None = None  # device KV block
    host_block_id: int | None = None
    snapshot: Snapshot | None = None
    children: dict[BlockHash, TreeNode] = field(default_factory=dict)

    @property
    def start(self) -> int:
        return self.ordinal * self.block_size

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_full(self) -> bool:
        return len(self.token_ids) == self.block_size

    def path(self) -> list[TreeNode]:
        """Nodes from the first block down to this one."""
        nodes = []
        node: TreeNode | None = self
        while node is not None and node.ordinal >= 0:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def subtree(self) -> Iterator[TreeNode]:
        """This node and every descendant, children before their parent."""
        for child in list(self.children.values()):
            yield from child.subtree()
        yield self


@dataclass(frozen=True)
class MatchedBlock:
    node: TreeNode
    num_tokens: int  # tokens of this node that match the lookup (== node size unless last)


@dataclass(frozen=True)
class Match:
    """A lookup result; side-effect free, valid until the tree next changes."""

    blocks: list[MatchedBlock]
    lookup_len: int

    @property
    def matched_len(self) -> int:
        """The attention-only reusable length (all matched tokens)."""
        return sum(b.num_tokens for b in self.blocks)


class PrefixTree:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.roots: dict[BlockHash, TreeNode] = {}

    def root(self, cache_salt: str | None) -> TreeNode:
        key = root_hash(cache_salt)
        if key not in self.roots:
            self.roots[key] = TreeNode(
                key=key, parent=None, token_ids=(), ordinal=-1, block_size=self.block_size
            )
        return self.roots[key]

    def nodes(self) -> Iterator[TreeNode]:
        for root in self.roots.values():
            for node in root.subtree():
                if node.ordinal >= 0:
                    yield node

    def match(self, token_ids: Sequence[int], cache_salt: str | None, *, partial: bool) -> Match:
        """Walk full blocks by key, then (with `partial`) the child sharing the longest
        prefix of the remaining tokens."""
        bs = self.block_size
        node = self.roots.get(root_hash(cache_salt))
        blocks: list[MatchedBlock] = []
        pos = 0
        while node is not None and pos + bs <= len(token_ids):
            tokens = tuple(token_ids[pos : pos + bs])
            child = node.children.get(block_hash(node.key, tokens))
            if child is None or child.token_ids != tokens:
                break
            blocks.append(MatchedBlock(child, bs))
            node, pos = child, pos + bs
        if partial and node is not None and 0 < len(node.children) < MAX_SCANNED_CHILDREN:
            rest = token_ids[pos : pos + bs]
            best, best_len = None, 0
            for child in node.children.values():
                common = _common_prefix(child.token_ids, rest)
                if common > best_len:
                    best, best_len = child, common
            if best is not None:
                blocks.append(MatchedBlock(best, best_len))
        return Match(blocks, len(token_ids))

    def child(self, parent: TreeNode, token_ids: Sequence[int]) -> TreeNode | None:
        node = parent.children.get(block_hash(parent.key, token_ids))
        return node if node is not None and node.token_ids == tuple(token_ids) else None

    def insert(self, parent: TreeNode, token_ids: Sequence[int]) -> TreeNode:
        """A new node (no pages yet) under `parent`; the caller checked `child` first."""
        tokens = tuple(token_ids)
        assert 0 < len(tokens) <= self.block_size and (parent.ordinal < 0 or parent.is_full)
        node = TreeNode(
            key=block_hash(parent.key, tokens),
            parent=parent,
            token_ids=tokens,
            ordinal=parent.ordinal + 1,
            block_size=self.block_size,
        )
        parent.children[node.key] = node
        return node

    def shorter_siblings(self, node: TreeNode) -> list[TreeNode]:
        """Partial siblings whose tokens are a strict prefix of `node`'s: `node` replaces them."""
        assert node.parent is not None
        return [
            s
            for s in node.parent.children.values()
            if s is not node
            and s.num_tokens < node.num_tokens
            and not s.children
            and node.token_ids[: s.num_tokens] == s.token_ids
        ]

    def detach(self, node: TreeNode) -> None:
        """Unlink `node` (and so its subtree) from its parent."""
        assert node.parent is not None
        del node.parent.children[node.key]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
