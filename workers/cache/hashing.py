"""Block keys: a SHA-256 chain over token ids, rooted in the reuse scope (the cache salt).

    root = H("hybridserve/root/v1" || salt)
    key(block i) = H(key(block i - 1) || token ids of block i as 4-byte little-endian)

Equal keys mean equal token prefixes (a 256-bit hash), so blocks match by key alone; different
salts (tenants) never share a block. The global prefix index computes the same chain.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def root_hash(cache_salt: str | None) -> BlockHash:
    salt = (cache_salt or "").encode()
    return BlockHash(hashlib.sha256(b"hybridserve/root/v1\x00" + salt).digest())


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return BlockHash(hashlib.sha256(parent + packed).digest())


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[BlockHash]:
    """Keys of the full blocks of `token_ids`, in order."""
    keys = []
    parent = root_hash(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
