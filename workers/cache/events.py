"""Cache events: what entered and left an engine's prefix tree, for a global prefix index.

Events are small versioned msgpack-ready messages (`to_dict` / `from_dict`), emitted in order;
an index that applies them in order knows which block keys and which snapshot positions this
engine holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

EVENTS_VERSION = 2


@dataclass(frozen=True)
class BlockStored:
    """A block entered the tree: `num_tokens` (1..block_size) tokens under `parent_hash`."""

    block_hash: bytes
    parent_hash: bytes
    num_tokens: int
    kind: ClassVar[str] = "block_stored"


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: bytes
    kind: ClassVar[str] = "block_removed"


@dataclass(frozen=True)
class SnapshotStored:
    """A snapshot of the recurrent state after `coverage` tokens of this block now exists
    (absolute position = block ordinal * block_size + coverage).

    `prefix_hash` keys the tokens the snapshot consumed in this block: the chain hash of the
    block's first `coverage` tokens under its parent. None when that is the whole block
    (`block_hash` itself); set only when a longer block adopted a shorter sibling's snapshot.
    An index matches a lookup against it without seeing any token."""

    block_hash: bytes
    coverage: int
    prefix_hash: bytes | None = None
    kind: ClassVar[str] = "snapshot_stored"


@dataclass(frozen=True)
class SnapshotRemoved:
    block_hash: bytes
    coverage: int
    kind: ClassVar[str] = "snapshot_removed"


CacheEvent = BlockStored | BlockRemoved | SnapshotStored | SnapshotRemoved
_KINDS: dict[str, type[Any]] = {
    cls.kind: cls for cls in (BlockStored, BlockRemoved, SnapshotStored, SnapshotRemoved)
}


def event_to_dict(event: CacheEvent) -> dict[str, Any]:
    return {"v": EVENTS_VERSION, "kind": event.kind, **asdict(event)}


def event_from_dict(data: dict[str, Any]) -> CacheEvent:
    if data.get("v") != EVENTS_VERSION:
        raise ValueError(f"cache event version {data.get('v')!r} is not {EVENTS_VERSION}")
    fields = {k: v for k, v in data.items() if k not in ("v", "kind")}
    try:
        return _KINDS[data["kind"]](**fields)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed cache event {data!r}: {exc}") from exc


class CacheEventSink(Protocol):
    """Receives an engine's cache events, in order, after each step that produced some."""

    def on_cache_events(self, events: list[CacheEvent]) -> None: ...
