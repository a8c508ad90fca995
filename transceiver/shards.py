"""Shard links: the data of every rank pair but (0, 0), between engines of any TP sizes.

A transfer's control (request, plan, done, ack) runs between the two engines' rank 0 on the
transfer link (endpoint.py), which also carries rank 0's shards for decode rank 0. Every other
pair of a prefill rank i and a decode rank j that share state (tp_mapping.plan) moves on a
shard link of its own, opened by rank i's `ShardSender` to rank j's `ShardReceiver`:

    prefill rank i                               decode rank j (armed by its rank 0 with the
                                                   plan before the plan is sent back)
                                   <--------     Challenge
    Hello(layout_i, backend info)  -------->     Hello(layout_j, backend info)  (auth.py)
                                   <--------
    ShardStart(request, i)         -------->     the copies it expects from rank i
    the pieces of i's shards j holds ------->    landed in its own pools (TCP bytes / NIXL)

Each decode rank computes what it expects from the plan its rank 0 gave it, never from the wire;
its rank 0 admits the request only once every rank has landed everything. Rank pairs move in
parallel: each rank sends from its own process, to every decode rank on its own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from hybridserve.transceiver.auth import PeerAuth
from hybridserve.transceiver.base import RegionCopy, TransferBackend, region_copies
from hybridserve.transceiver.channel import Channel, Listener, TransferFailed
from hybridserve.transceiver.layout import LayoutMismatch, PeerLayout, check_compatible
from hybridserve.transceiver.protocol import (
    CONTROL_MAX_BYTES,
    Hello,
    ReceivePlan,
    ShardStart,
    TransferError,
)
from hybridserve.transceiver.tp_mapping import pair_pieces

logger = logging.getLogger(__name__)

Address = tuple[str, int]
T = TypeVar("T")


def rank_layout(layout: PeerLayout, rank: int) -> PeerLayout:
    """Rank `rank` of the engine `layout` describes (every rank has the same shapes)."""
    return dataclasses.replace(layout, tp_rank=rank)


def shard_copies(
    backend: TransferBackend,
    sender: PeerLayout,
    receiver: PeerLayout,
    src_blocks: list[int],
    src_slot: int,
    plan: ReceivePlan,
) -> list[RegionCopy]:
    """What rank `sender.tp_rank` sends rank `receiver.tp_rank` of the request in `plan`."""
    return region_copies(backend.pools, src_blocks, src_slot, plan, pair_pieces(sender, receiver))


def _check_peer(layout: PeerLayout, backend: TransferBackend, hello: Hello) -> None:
    """Same model, compatible TP, same backend; LayoutMismatch otherwise."""
    if hello.backend != backend.name:
        raise LayoutMismatch(f"shard peer uses backend {hello.backend!r}, ours {backend.name!r}")
    check_compatible(layout, hello.layout)


@dataclass
class _Expected:
    copies: dict[int, list[RegionCopy]]  # source rank -> what this rank lands from it
    done: set[int] = field(default_factory=set)
    error: str | None = None
    event: threading.Event = field(default_factory=threading.Event)

    def settle(self) -> None:
        if self.error is not None or self.done >= set(self.copies):
            self.event.set()


class ShardReceiver:
    """A decode rank's shard links: lands the pieces its rank 0 armed it for."""

    def __init__(
        self,
        layout: PeerLayout,
        backend: TransferBackend,
        *,
        secret: str | bytes,
        host: str,
        timeout: float = 30.0,
        deadline: float = 60.0,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.auth = PeerAuth(secret)
        self.timeout = timeout
        self.deadline = deadline
        self._expected: dict[str, _Expected] = {}
        self._lock = threading.Lock()
        self._listener = Listener(host, self._serve, timeout=timeout, name="shard-receiver")
        self.address: Address = self._listener.address

    def expect(self, request_id: str, plan: ReceivePlan, sender: PeerLayout) -> None:
        """Arm for a request: from each sender rank, the copies of its shards this rank holds
        (pair (0, 0) excluded: the transfer link carries it)."""
        copies = {}
        for rank in range(sender.tp_size):
            if rank == 0 and self.layout.tp_rank == 0:
                continue
            expected = self._expected_from(rank_layout(sender, rank), plan)
            if expected:
                copies[rank] = expected
        entry = _Expected(copies)
        entry.settle()
        with self._lock:
            self._expected[request_id] = entry

    def _expected_from(self, sender: PeerLayout, plan: ReceivePlan) -> list[RegionCopy]:
        num_blocks = plan.held_blocks + len(plan.dst_block_ids)
        return [
            RegionCopy(c.kind, -1, c.dst, c.pieces)
            for c in shard_copies(self.backend, sender, self.layout, [-1] * num_blocks, -1, plan)
        ]

    def wait(self, request_id: str, timeout: float) -> None:
        """Until every armed piece of the request has landed; TransferFailed otherwise. The
        request is disarmed either way."""
        with self._lock:
            entry = self._expected.get(request_id)
        if entry is None:
            raise TransferFailed(f"request {request_id}: no shards were expected on this rank")
        try:
            if not entry.event.wait(timeout):
                missing = sorted(set(entry.copies) - entry.done)
                raise TransferFailed(
                    f"request {request_id}: rank {self.layout.tp_rank} has no shards from "
                    f"prefill ranks {missing} after {timeout} s"
                )
            if entry.error is not None:
                raise TransferFailed(entry.error)
        finally:
            self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)

    def _serve(self, channel: Channel) -> None:
        peer = ""
        try:
            accepted = self.auth.accept(channel)
            hello = accepted.hello
            try:
                _check_peer(self.layout, self.backend, hello)
            except LayoutMismatch as exc:
                channel.send(TransferError("", "layout_mismatch", str(exc)))
                raise
            peer = self.backend.add_peer(hello.backend_info)
            ours = Hello(self.layout, self.backend.name, self.backend.local_info())
            self.auth.answer(channel, accepted, ours)
            source = hello.layout.tp_rank
            stopped = self._listener.stopped
            while (start := channel.next_message(stopped, max_bytes=CONTROL_MAX_BYTES)) is not None:
                if not isinstance(start, ShardStart) or start.src_rank != source:
                    raise TransferFailed(f"expected ShardStart from rank {source}, got {start!r}")
                self._land(channel, peer, start)
        except (TransferFailed, LayoutMismatch) as exc:
            logger.info("shard link closed: %s", exc)
        finally:
            if peer:
                self.backend.remove_peer(peer)
            channel.close()

    def _land(self, channel: Channel, peer: str, start: ShardStart) -> None:
        with self._lock:
            entry = self._expected.get(start.request_id)
        copies = entry.copies.get(start.src_rank) if entry is not None else None
        if entry is None or copies is None:
            # Nothing to check the data against (aborted, or never ours): the link goes.
            raise TransferFailed(
                f"request {start.request_id}: rank {self.layout.tp_rank} expects no shards "
                f"from rank {start.src_rank}"
            )
        try:
            with channel.deadline(self.deadline):
                self.backend.receive(
                    channel, peer, start.request_id, copies, channel.time_left(self.timeout)
                )
        except TransferFailed as exc:
            entry.error = f"rank {self.layout.tp_rank} from rank {start.src_rank}: {exc}"
            entry.settle()
            raise
        entry.done.add(start.src_rank)
        entry.settle()

    def close(self) -> None:
        self._listener.close()


@dataclass
class _Link:
    channel: Channel
    peer: str
    lock: threading.Lock = field(default_factory=threading.Lock)


class ShardSender:
    """A prefill rank's shard links, one per decode rank it has sent to."""

    def __init__(
        self,
        layout: PeerLayout,
        backend: TransferBackend,
        *,
        secret: str | bytes,
        timeout: float = 30.0,
        deadline: float = 60.0,
    ):
        self.layout = layout
        self.backend = backend
        self.auth = PeerAuth(secret)
        self.timeout = timeout
        self.deadline = deadline
        self._links: dict[Address, _Link] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="shard-send")

    def send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: ReceivePlan,
        receiver: PeerLayout,
        addresses: list[Address],
    ) -> int:
        """This rank's shards of the request to every decode rank that holds some of them
        (pair (0, 0) excluded), all decode ranks in parallel; returns the bytes sent. Raises
        TransferFailed after every send has finished or failed."""
        jobs = []
        for rank in range(receiver.tp_size):
            if rank == 0 and self.layout.tp_rank == 0:
                continue
            copies = shard_copies(
                self.backend, self.layout, rank_layout(receiver, rank), src_blocks, src_slot, plan
            )
            if copies:
                jobs.append(self._pool.submit(self._send, request_id, copies, addresses[rank]))
        errors = [exc for job in jobs if (exc := job.exception()) is not None]
        if errors:
            raise (
                errors[0]
                if isinstance(errors[0], TransferFailed)
                else TransferFailed(f"request {request_id}: shard send failed: {errors[0]}")
            )
        return sum(job.result() for job in jobs)

    def _send(self, request_id: str, copies: list[RegionCopy], address: Address) -> int:
        link = self._link(address)
        with link.lock:
            channel = link.channel
            try:
                with channel.deadline(self.deadline):
                    channel.send(ShardStart(request_id, self.layout.tp_rank))
                    self.backend.send(
                        channel, link.peer, request_id, copies, channel.time_left(self.timeout)
                    )
            except TransferFailed:
                self._drop(address)  # its state is unknown: the next request reconnects
                raise
        return sum(
            sum(n for _, _, n in c.byte_ranges(self.backend.pools.region(c.kind, c.src).nbytes))
            for c in copies
        )

    def _link(self, address: Address) -> _Link:
        with self._lock:
            link = self._links.get(address)
            if link is not None:
                return link
            channel = Channel.connect(address, self.timeout)
            try:
                ours = Hello(self.layout, self.backend.name, self.backend.local_info())
                hello = self.auth.connect(channel, ours)
                _check_peer(self.layout, self.backend, hello)
                peer = self.backend.add_peer(hello.backend_info)
            except (TransferFailed, LayoutMismatch) as exc:
                channel.close()
                raise TransferFailed(f"shard link to {address}: {exc}") from exc
            link = self._links[address] = _Link(channel, peer)
            return link

    def _drop(self, address: Address) -> None:
        with self._lock:
            link = self._links.pop(address, None)
        if link is not None:
            link.channel.close()
            self.backend.remove_peer(link.peer)

    def close(self) -> None:
        for address in list(self._links):
            self._drop(address)
        self._pool.shutdown(wait=False)


class RankShards:
    """One rank's shard links: its receiver (decode role), its sender (prefill role)."""

    def __init__(
        self, receiver: ShardReceiver | None = None, sender: ShardSender | None = None
    ) -> None:
        self.receiver = receiver
        self.sender = sender

    def address(self) -> Address:
        assert self.receiver is not None, "a decode engine's rank has a shard receiver"
        return self.receiver.address

    def expect(self, request_id: str, plan: ReceivePlan, sender: PeerLayout) -> None:
        assert self.receiver is not None
        self.receiver.expect(request_id, plan, sender)

    def wait(self, request_id: str, timeout: float) -> None:
        assert self.receiver is not None
        self.receiver.wait(request_id, timeout)

    def cancel(self, request_id: str) -> None:
        if self.receiver is not None:
            self.receiver.cancel(request_id)

    def send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: ReceivePlan,
        receiver: PeerLayout,
        addresses: list[Address],
    ) -> int:
        assert self.sender is not None
        return self.sender.send(request_id, src_blocks, src_slot, plan, receiver, addresses)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()


class RankShardsPort(Protocol):
    """`RankShards` wherever the rank runs (this process, or a rank actor behind a proxy)."""

    def address(self) -> Address: ...

    def expect(self, request_id: str, plan: ReceivePlan, sender: PeerLayout) -> None: ...

    def wait(self, request_id: str, timeout: float) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: ReceivePlan,
        receiver: PeerLayout,
        addresses: list[Address],
    ) -> int: ...


class EngineShards:
    """An engine's shard links over all its ranks (rank order), as its rank 0 drives them."""

    def __init__(self, ranks: list[RankShardsPort]) -> None:
        self.ranks = ranks
        self._fanout = ThreadPoolExecutor(max(1, len(ranks)), thread_name_prefix="shard-ranks")

    def addresses(self) -> list[Address]:
        """Decode role: where each rank accepts shard links."""
        return [rank.address() for rank in self.ranks]

    def expect(self, request_id: str, plan: ReceivePlan, sender: PeerLayout) -> None:
        """Decode role: arm every rank for the request (before the plan goes back)."""
        for rank in self.ranks:
            rank.expect(request_id, plan, sender)

    def wait(self, request_id: str, timeout: float) -> None:
        """Decode role: until every rank has landed its pieces (TransferFailed otherwise;
        every rank is disarmed either way)."""
        self._all(lambda rank: rank.wait(request_id, timeout))

    def cancel(self, request_id: str) -> None:
        for rank in self.ranks:
            rank.cancel(request_id)

    def send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: ReceivePlan,
        receiver: PeerLayout,
        addresses: list[Address],
    ) -> int:
        """Prefill role: every rank's shards, all ranks in parallel; the bytes sent."""
        return sum(
            self._all(
                lambda rank: rank.send(request_id, src_blocks, src_slot, plan, receiver, addresses)
            )
        )

    def _all(self, call: Callable[[RankShardsPort], T]) -> list[T]:
        """`call` on every rank in parallel; raises the first failure after all finished."""
        jobs = [self._fanout.submit(call, rank) for rank in self.ranks]
        errors = [exc for job in jobs if (exc := job.exception()) is not None]
        if errors:
            first = errors[0]
            raise first if isinstance(first, TransferFailed) else TransferFailed(str(first))
        return [job.result() for job in jobs]
