"""Cache data moves: what a cache manager decided, as values the model runner applies later.

Managers never touch tensors. When a decision needs bytes moved (a cached block evicted to the
host tier, a reused block's rows copied, a snapshot restored into a live slot or taken from
one), the manager appends an op to the engine's `CacheOpLog`. The scheduler drains the log into
the next step plan, and every rank applies the ops in order before that step's forward pass.

Order is the whole contract: an op is logged at the moment of the decision, so applying the log
in order reproduces "copy, then hand the page to its next user". The ops a commit logs after
step N (snapshot captures) run at the head of step N + 1's plan, before anything writes the live
slots again. See docs/step-plan.md.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class CopyBlock:
    """The first `num_tokens` token rows of KV block `src` into block `dst`."""

    src: int
    dst: int
    num_tokens: int
    kind: ClassVar[str] = "copy_block"


@dataclass(frozen=True, slots=True)
class CopySlot:
    """State slot `src` (every state tensor, every recurrent layer) into slot `dst`: a snapshot
    capture (live -> snapshot) or a restore (snapshot -> live)."""

    src: int
    dst: int
    kind: ClassVar[str] = "copy_slot"


@dataclass(frozen=True, slots=True)
class OffloadBlock:
    """Device KV block -> host-tier block."""

    block_id: int
    host_id: int
    kind: ClassVar[str] = "offload_block"


@dataclass(frozen=True, slots=True)
class LoadBlock:
    """Host-tier block -> device KV block."""

    host_id: int
    block_id: int
    kind: ClassVar[str] = "load_block"


@dataclass(frozen=True, slots=True)
class OffloadSlot:
    """Device state slot -> host-tier slot."""

    slot: int
    host_slot: int
    kind: ClassVar[str] = "offload_slot"


@dataclass(frozen=True, slots=True)
class LoadSlot:
    """Host-tier slot -> device state slot."""

    host_slot: int
    slot: int
    kind: ClassVar[str] = "load_slot"


CacheOp = CopyBlock | CopySlot | OffloadBlock | LoadBlock | OffloadSlot | LoadSlot
OP_TYPES: dict[str, Any] = {
    cls.kind: cls for cls in (CopyBlock, CopySlot, OffloadBlock, LoadBlock, OffloadSlot, LoadSlot)
}


def op_to_wire(op: CacheOp) -> list[Any]:
    """[kind, *fields]: compact and msgpack-ready."""
    return [op.kind, *astuple(op)]


def op_from_wire(data: list[Any]) -> CacheOp:
    try:
        kind, *fields = data
        op = OP_TYPES[kind](*fields)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed cache op {data!r}: {exc}") from exc
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields):
        raise ValueError(f"cache op {data!r}: every field must be a non-negative integer")
    return op


class CacheOpLog:
    """The ops decided since the last step plan, in decision order."""

    def __init__(self) -> None:
        self._ops: list[CacheOp] = []

    def append(self, op: CacheOp) -> None:
        self._ops.append(op)

    def take(self) -> list[CacheOp]:
        ops, self._ops = self._ops, []
        return ops

    def __len__(self) -> int:
        return len(self._ops)
