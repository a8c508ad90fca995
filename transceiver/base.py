"""The backend interface: how one request's regions move from a sender's pools to a receiver's.

A region is one KV block (every attention layer, K and V) or one slot of one recurrent state
tensor (every recurrent layer): one contiguous piece of a pool on each side. Both sides derive the
same list of `RegionCopy`s from the receive plan, so the receiver knows exactly which bytes to
accept and where they go; it never takes a destination from the wire.

Backends are chosen by name (`registry.create_backend`); each registers the engine's pools once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from hybridserve.transceiver.channel import Channel
from hybridserve.transceiver.protocol import ReceivePlan
from hybridserve.transceiver.tp_mapping import Piece

# "kv", or the name of a recurrent state tensor ("conv", "ssm", "recurrent", ...).
RegionKind = str


class StatePools(Protocol):
    """An engine's state pools as its model runner holds them (`StateCaches`)."""

    def pools(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Pools:
    """An engine's transferable memory (the model runner's state caches), by region kind:
    "kv" (one block per index), then each state tensor (one slot per index), in pool order."""

    tensors: dict[str, torch.Tensor]

    @classmethod
    def of(cls, caches: StatePools) -> Pools:
        """An engine's pools: its model runner's state caches (`engine.runner.caches`)."""
        return cls(caches.pools())

    @property
    def state_kinds(self) -> list[str]:
        return [kind for kind in self.tensors if kind != "kv"]

    def region(self, kind: RegionKind, index: int) -> torch.Tensor:
        pool = self.tensors[kind]
        assert pool[index].is_contiguous()
        return pool[index]


@dataclass(frozen=True)
class RegionCopy:
    kind: RegionKind
    src: int  # the sender's block id / slot
    dst: int  # the receiver's block id / slot
    # Byte ranges (source offset, destination offset, bytes) inside the two regions, when the
    # two sides shard the state differently (tp_mapping.region_pieces); empty: the whole
    # region, laid out alike on both sides.
    pieces: tuple[Piece, ...] = ()

    def byte_ranges(self, region_bytes: int) -> tuple[Piece, ...]:
        return self.pieces or ((0, 0, region_bytes),)


def region_copies(
    pools: Pools,
    src_blocks: list[int],
    src_slot: int,
    plan: ReceivePlan,
    pieces: dict[str, tuple[Piece, ...]] | None = None,
) -> list[RegionCopy]:
    """KV blocks the receiver does not hold yet, then the live state slot (the state after the
    whole prompt travels last: it only means something with every block in place). `pieces`
    (per kind) carries one rank pair's shards between different TP layouts; a kind without
    pieces there has nothing to move for this pair."""
    copies: list[RegionCopy] = []

    def wanted(kind: str) -> bool:
        return kind in pools.tensors and (pieces is None or bool(pieces.get(kind)))

    def of(kind: str) -> tuple[Piece, ...]:
        return () if pieces is None else pieces[kind]

    if wanted("kv"):
        for src, dst in zip(src_blocks[plan.held_blocks :], plan.dst_block_ids, strict=True):
            copies.append(RegionCopy("kv", src, dst, of("kv")))
    for kind in pools.state_kinds:
        if wanted(kind):
            copies.append(RegionCopy(kind, src_slot, plan.dst_slot, of(kind)))
    return copies


class TransferBackend(ABC):
    name: ClassVar[str]

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    def local_info(self) -> bytes:
        """What a peer needs to reach this engine's memory (sent in the Hello)."""
        return b""

    def add_peer(self, info: bytes) -> str:
        """Accept a peer's `local_info`; returns the handle `send` / `receive` use for it."""
        return ""

    @abstractmethod
    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        """Sender: move every region; returns once the receiver can read them (raises
        TransferFailed otherwise)."""

    @abstractmethod
    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        """Receiver: return once every region has fully arrived (raises TransferFailed)."""

    def remove_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Forget a peer (its connection closed). Nothing to do for stateless backends."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release registrations. Nothing to do for stateless backends."""
