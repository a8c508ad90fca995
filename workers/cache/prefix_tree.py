"""The prefix tree: which token prefixes have KV blocks and recurrent state snapshots here.

A node is one block of one prefix: up to `block_size` tokens under its parent, keyed by the
chained block hash. Interior nodes are always full; a path may end in a partial node. A node
may carry one recurrent state snapshot: the state after `coverage` tokens of that block (absolute
position ordinal * block_size + coverage), and only the latest (largest) coverage is kept per node.

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
    slot: int | None = None  # device slot in the state pools
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
    """A lookup result; side-effect free, valid until the tree next changes.

    `blocks` are the fully matching blocks, in order. `levels[i]` lists every node of block i
    (a child of blocks[i - 1]) that shares a prefix with the lookup there, longest first: the
    full match itself and, with partial matching, siblings sharing fewer tokens. Siblings in
    one block can carry different snapshots, so the reuse decision looks at all of them.

        lookup:    [ block 0 ][ block 1 ][ block 2 ][ blo.. ]
        blocks:    [  full   ][  full   ][  full   ]
        levels[2]: full node of block 2, a 9-token partial sibling, ...
        levels[3]: partial candidates for the rest (no full match there)
    """

    blocks: list[MatchedBlock]
    levels: list[list[MatchedBlock]]
    lookup_len: int

    @property
    def matched_len(self) -> int:
        """The attention-only reusable length (all matched tokens)."""
        full = sum(b.num_tokens for b in self.blocks)
        beyond = self.levels[len(self.blocks)] if len(self.levels) > len(self.blocks) else []
        return full + (beyond[0].num_tokens if beyond else 0)


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
        """Walk full blocks by key; with `partial`, also collect at each block the nodes that
        share a shorter prefix with the lookup (including past the last full match)."""
        bs = self.block_size
        node = self.roots.get(root_hash(cache_salt))
        blocks: list[MatchedBlock] = []
        levels: list[list[MatchedBlock]] = []
        pos = 0
        while node is not None and pos < len(token_ids):
            tokens = tuple(token_ids[pos : pos + bs])
            level: list[MatchedBlock] = []
            full = node.children.get(block_hash(node.key, tokens)) if len(tokens) == bs else None
            if full is not None and full.token_ids == tokens:
                level.append(MatchedBlock(full, bs))
            else:
                full = None
            if partial and len(node.children) < MAX_SCANNED_CHILDREN:
                for child in node.children.values():
                    if child is not full:
                        common = common_prefix_len(child.token_ids, tokens)
                        if common > 0:
                            level.append(MatchedBlock(child, common))
                level.sort(key=lambda m: -m.num_tokens)
            if level:
                levels.append(level)
            if full is None:
                break
            blocks.append(MatchedBlock(full, bs))
            node, pos = full, pos + bs
        return Match(blocks, levels, len(token_ids))

    def walk(self, keys: Sequence[bytes], cache_salt: str | None) -> list[TreeNode]:
        """The nodes of a chain of full-block keys, as far as the tree has them."""
        nodes: list[TreeNode] = []
        node = self.roots.get(root_hash(cache_salt))
        for key in keys:
            node = node.children.get(BlockHash(key)) if node is not None else None
            if node is None or not node.is_full:
                break
            nodes.append(node)
        return nodes

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


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
