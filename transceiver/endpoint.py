"""The two ends of a transfer link: a sender next to a prefill engine, a receiver next to a
decode engine. Each drives its engine through a small port (duck-typed; the transceiver does
not import the engine) under the caller's lock, since the engine's own loop steps in parallel
(all but `handoff_source`, which needs none).

    sender (prefill)                             receiver (decode)
             <---------------------- Challenge   (auth.py: the peer proves the deployment's
    connect: Hello + proof ----------------->     secret first, then check layout / hash,
             <------------------ Hello + proof    add peer; or TransferError: unauthenticated
                                                  | layout_mismatch)
    send(handoff): TransferRequest -------->    decode.prepare_receive
             <-- ReceivePlan | TransferError     (rejections hold nothing)
    backend.send (regions)  ------ bytes ---->   backend.receive into the plan's destinations
    TransferDone ---------------------------->   decode.complete_receive
             <------------------- TransferAck    (any failure: decode.fail_receive)
    prefill.release_handoff("acked")

The handoff's pages are pinned from the moment the sender reads where they are until the send
ends: a lease that expires or an abort that arrives meanwhile only marks the handoff, and the
pages are freed when the send is over (a page freed mid-send could be handed to another request
and overwritten while its bytes are still going out). A transfer has a total deadline on both
sides besides each read's inactivity timeout, so the pin is bounded too.

A failure on the link closes it (its state is unknown); the sender reconnects for the next
request. The prefill side frees a failed handoff at once when its backend guarantees no read
is still in flight (TCP), otherwise at lease expiry.

Between engines of different tensor-parallel sizes (or any engine of several ranks), this link
carries the control and rank 0's shards for decode rank 0; every other rank pair moves on its
own shard link (shards.py), armed before the plan goes back and waited for before the request
is admitted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from hybridserve.transceiver.auth import PeerAuth, Unauthenticated
from hybridserve.transceiver.base import Pools, RegionCopy, TransferBackend, region_copies
from hybridserve.transceiver.channel import Channel, Listener, TransferFailed
from hybridserve.transceiver.layout import LayoutMismatch, PeerLayout, check_compatible
from hybridserve.transceiver.protocol import (
    CONTROL_MAX_BYTES,
    Hello,
    ReceivePlan,
    TransferAbort,
    TransferAck,
    TransferDone,
    TransferError,
    TransferRequest,
)
from hybridserve.transceiver.shards import EngineShards, rank_layout
from hybridserve.transceiver.tp_mapping import Piece, pair_pieces

logger = logging.getLogger(__name__)


class PrefillPort(Protocol):
    def handoff_source(self, request_id: str) -> tuple[list[int], int] | None:
        """Where the handoff's data is, pinned until `release_handoff` / `unpin_handoff`.
        Called without the lock: the engine's step holds it, and a transfer would wait
        through a whole prefill step before its first byte."""
        ...

    def release_handoff(self, request_id: str, reason: str) -> bool: ...

    def unpin_handoff(self, request_id: str) -> None:
        """The send is over but its pages wait for the lease (a write may still read them)."""
        ...


class DecodePort(Protocol):
    def prepare_receive(self, message: TransferRequest) -> ReceivePlan: ...

    def complete_receive(self, request_id: str) -> None: ...

    def fail_receive(self, request_id: str, reason: str, *, writer_done: bool) -> Any: ...


@dataclass(frozen=True)
class SendOutcome:
    request_id: str
    status: str  # "acked" | "rejected" | "failed"
    detail: str = ""  # the rejection code or failure reason
    blocks_sent: int = 0  # KV blocks that crossed the link
    blocks_held: int = 0  # KV blocks the receiver already had (not sent)
    bytes_sent: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "acked"


def needs_shard_links(sender: PeerLayout, receiver: PeerLayout) -> bool:
    """Whether rank pairs other than (0, 0) exchange state."""
    return sender.tp_size > 1 or receiver.tp_size > 1


def rank0_pieces(sender: PeerLayout, receiver: PeerLayout) -> dict[str, tuple[Piece, ...]] | None:
    """What rank 0 sends rank 0 on the transfer link: whole regions between equal layouts,
    its share of them otherwise."""
    if sender.tp_size == receiver.tp_size:
        return None
    return pair_pieces(rank_layout(sender, 0), rank_layout(receiver, 0))


def _handshake_reply(
    channel: Channel,
    auth: PeerAuth,
    layout: PeerLayout,
    backend: TransferBackend,
    shards: EngineShards | None,
) -> tuple[str, PeerLayout]:
    """Receiver half of the handshake; returns the peer's backend handle and layout."""
    accepted = auth.accept(channel)
    hello = accepted.hello
    try:
        if hello.backend != backend.name:
            raise LayoutMismatch(
                f"peer uses transfer backend {hello.backend!r}, this engine "
                f"{backend.name!r}: both sides must use the same one"
            )
        check_compatible(layout, hello.layout)
        if shards is None and needs_shard_links(hello.layout, layout):
            raise LayoutMismatch(
                f"a prefill engine of tensor_parallel_size {hello.layout.tp_size} needs shard "
                "links, and this engine has none"
            )
    except LayoutMismatch as exc:
        channel.send(TransferError("", "layout_mismatch", str(exc)))
        raise
    peer = backend.add_peer(hello.backend_info)
    addresses = [list(a) for a in shards.addresses()] if shards is not None else []
    auth.answer(channel, accepted, Hello(layout, backend.name, backend.local_info(), addresses))
    return peer, hello.layout


class TransferReceiver:
    """Accepts prefill peers on a TCP port and lands their transfers in a decode engine.
    `timeout`: the longest any read waits; `deadline`: the longest one transfer takes;
    `admit(request_id)`: whether the decode side takes the request (it may wait for it),
    else the transfer is refused before anything is held."""

    def __init__(
        self,
        decode: DecodePort,
        layout: PeerLayout,
        backend: TransferBackend,
        *,
        secret: str | bytes,
        lock: threading.Lock,
        host: str,
        port: int = 0,
        timeout: float = 30.0,
        deadline: float = 60.0,
        shards: EngineShards | None = None,
        admit: Callable[[str], bool] | None = None,
    ) -> None:
        self.decode = decode
        self.layout = layout
        self.admit = admit
        self.backend = backend
        self.auth = PeerAuth(secret)
        self.lock = lock
        self.timeout = timeout
        self.deadline = deadline
        self.shards = shards
        # Links closed in their handshake, by reason: unauthenticated, layout_mismatch,
        # malformed (spoke something that is not our protocol, or nothing in time).
        self.refused_links: dict[str, int] = {}
        self._listener = Listener(
            host, self._serve, timeout=timeout, name="transfer-receiver", port=port
        )
        self.address = self._listener.address

    def _serve(self, channel: Channel) -> None:
        peer = ""
        try:
            try:
                peer, sender = _handshake_reply(
                    channel, self.auth, self.layout, self.backend, self.shards
                )
            except (TransferFailed, LayoutMismatch) as exc:
                reason = (
                    "unauthenticated"
                    if isinstance(exc, Unauthenticated)
                    else "layout_mismatch"
                    if isinstance(exc, LayoutMismatch)
                    else "malformed"
                )
                self.refused_links[reason] = self.refused_links.get(reason, 0) + 1
                logger.warning("transfer link refused (%s): %s", reason, exc)
                return
            while (message := channel.next_message(self._listener.stopped)) is not None:
                if isinstance(message, TransferRequest):
                    self._receive(channel, peer, sender, message)
                elif isinstance(message, TransferAbort):
                    with self.lock:
                        self.decode.fail_receive(
                            message.request_id, message.reason, writer_done=True
                        )
        except (TransferFailed, LayoutMismatch) as exc:
            logger.info("transfer link closed: %s", exc)
        finally:
            if peer:
                self.backend.remove_peer(peer)
            channel.close()

    def _receive(
        self, channel: Channel, peer: str, sender: PeerLayout, message: TransferRequest
    ) -> None:
        request_id = message.request_id
        if self.admit is not None and not self.admit(request_id):
            channel.send(
                TransferError(request_id, "not_expected", f"request {request_id} is not expected")
            )
            return
        shards = self.shards if needs_shard_links(sender, self.layout) else None
        with self.lock:
            try:
                plan = self.decode.prepare_receive(message)
            except ValueError as exc:
                channel.send(TransferError(request_id, getattr(exc, "code", "rejected"), str(exc)))
                return
        try:
            if shards is not None:  # every rank knows what it lands before anything is sent
                shards.expect(request_id, plan, sender)
        except Exception as exc:
            with self.lock:
                self.decode.fail_receive(request_id, f"shards not armed: {exc}", writer_done=True)
            channel.send(TransferError(request_id, "shards_unavailable", str(exc)))
            return
        try:
            channel.send(plan)
        except TransferFailed:
            with self.lock:  # nothing was sent to it: nothing can land
                self.decode.fail_receive(request_id, "the sender went away", writer_done=True)
            if shards is not None:
                shards.cancel(request_id)
            raise
        num_blocks = plan.held_blocks + len(plan.dst_block_ids)
        copies = [
            RegionCopy(c.kind, -1, c.dst, c.pieces)
            for c in region_copies(
                self.backend.pools,
                [-1] * num_blocks,
                -1,
                plan,
                rank0_pieces(sender, self.layout),
            )
        ]
        try:
            with channel.deadline(self.deadline):
                self.backend.receive(
                    channel, peer, request_id, copies, channel.time_left(self.timeout)
                )
                done = channel.receive(self.timeout, max_bytes=CONTROL_MAX_BYTES)
                if isinstance(done, TransferAbort):
                    raise TransferFailed(f"sender aborted: {done.reason}")
                if not isinstance(done, TransferDone) or done.request_id != request_id:
                    raise TransferFailed(
                        f"request {request_id}: expected TransferDone, got {done!r}"
                    )
                if shards is not None:
                    shards.wait(request_id, channel.time_left(self.timeout))
        except TransferFailed as exc:
            if shards is not None:
                shards.cancel(request_id)
            with self.lock:
                # A TCP link is the only writer: once it failed nothing else can land. NIXL
                # writes come from the peer's NIC, and shard links from other ranks, so those
                # pages wait in quarantine.
                self.decode.fail_receive(
                    request_id,
                    str(exc),
                    writer_done=self.backend.name == "tcp" and shards is None,
                )
            raise
        with self.lock:
            try:
                self.decode.complete_receive(request_id)
            except ValueError as exc:  # aborted here while its data was arriving
                channel.send(TransferError(request_id, getattr(exc, "code", "rejected"), str(exc)))
                return
        channel.send(TransferAck(request_id))

    def close(self) -> None:
        self._listener.close()


@dataclass
class _Send:
    """How far one send got: what its failure must still release or wait for."""

    pinned: bool = False  # the handoff's pages are pinned (handoff_source answered)
    data_started: bool = False
    shards: Future[int] | None = None  # the other ranks' sends, while they run


class TransferSender:
    """Sends a prefill engine's handoffs to one decode peer (`timeout`, `deadline`: as the
    receiver's)."""

    def __init__(
        self,
        prefill: PrefillPort,
        layout: PeerLayout,
        backend: TransferBackend,
        peer_address: tuple[str, int],
        *,
        secret: str | bytes,
        lock: threading.Lock,
        timeout: float = 30.0,
        deadline: float = 60.0,
        shards: EngineShards | None = None,
    ) -> None:
        self.prefill = prefill
        self.layout = layout
        self.backend = backend
        self.peer_address = peer_address
        self.auth = PeerAuth(secret)
        self.lock = lock
        self.timeout = timeout
        self.deadline = deadline
        self.shards = shards
        self._channel: Channel | None = None
        self._peer = ""
        self._receiver: Hello | None = None  # the decode peer's Hello
        self._shard_sends = ThreadPoolExecutor(1, thread_name_prefix="shard-fanout")

    def connect(self) -> None:
        """Open the link and check the peer's layout (LayoutMismatch if incompatible)."""
        channel = Channel.connect(self.peer_address, self.timeout)
        try:
            reply = self.auth.connect(
                channel, Hello(self.layout, self.backend.name, self.backend.local_info())
            )
            check_compatible(self.layout, reply.layout)
            if needs_shard_links(self.layout, reply.layout) and (
                self.shards is None or len(reply.shard_addresses) != reply.layout.tp_size
            ):
                raise LayoutMismatch(
                    f"engines of tensor_parallel_size {self.layout.tp_size} and "
                    f"{reply.layout.tp_size} need shard links on both sides"
                )
            self._peer = self.backend.add_peer(reply.backend_info)
        except BaseException:
            channel.close()
            raise
        self._channel = channel
        self._receiver = reply

    def send(self, request_id: str, message: TransferRequest) -> SendOutcome:
        """Transfer one handed-off request; its pages are released on ack or rejection, and on
        failure at once (TCP) or at lease expiry (NIXL: a read may still be in flight)."""
        if self._channel is None:
            try:
                self.connect()
            except (TransferFailed, LayoutMismatch) as exc:
                return self._release(request_id, "failed", str(exc), now=True)
        channel = self._channel
        assert channel is not None
        send = _Send()
        try:
            with channel.deadline(self.deadline):
                outcome = self._exchange(channel, request_id, message, send)
        except Exception as exc:
            # NOTE: whatever went wrong (a TransferFailed, or a bug that raised anything else),
            # the request is resolved: the peer is told, the link starts afresh, the pages go.
            if not isinstance(exc, TransferFailed):
                logger.exception("request %s: the send raised unexpectedly", request_id)
            with contextlib.suppress(TransferFailed):
                channel.send(TransferAbort(request_id, str(exc) or type(exc).__name__))
            self.close_link()
            if send.shards is not None:  # the other ranks still read the pages until they end
                send.shards.exception()
            safe = not send.data_started or self.backend.name == "tcp"
            if send.pinned and not safe:
                with self.lock:
                    self.prefill.unpin_handoff(request_id)
            return self._release(request_id, "failed", str(exc) or type(exc).__name__, now=safe)
        status = "acked" if outcome.ok else outcome.status
        self._release(request_id, status, outcome.detail, now=True)
        return outcome

    def _exchange(
        self, channel: Channel, request_id: str, message: TransferRequest, send: _Send
    ) -> SendOutcome:
        """Request, plan, data, done, ack: the outcome (acked or rejected), or raises."""
        channel.send(message)
        reply = channel.receive(self.timeout, max_bytes=CONTROL_MAX_BYTES)
        if isinstance(reply, TransferError):
            return SendOutcome(request_id, "rejected", f"{reply.code}: {reply.message}")
        if not isinstance(reply, ReceivePlan) or reply.request_id != request_id:
            raise TransferFailed(f"request {request_id}: expected a ReceivePlan, got {reply!r}")
        source = self.prefill.handoff_source(request_id)
        if source is None:
            raise TransferFailed(
                f"request {request_id}: the handoff was released (lease "
                "expired or aborted) before its data was sent"
            )
        send.pinned = True
        src_blocks, src_slot = source
        receiver = self._receiver
        assert receiver is not None
        copies = region_copies(
            self.backend.pools,
            src_blocks,
            src_slot,
            reply,
            rank0_pieces(self.layout, receiver.layout),
        )
        send.data_started = True
        if needs_shard_links(self.layout, receiver.layout):
            assert self.shards is not None  # connect() refused the peer otherwise
            addresses = [(str(a[0]), int(a[1])) for a in receiver.shard_addresses]
            # Every other rank pair moves meanwhile, each from its own rank.
            send.shards = self._shard_sends.submit(
                self.shards.send,
                request_id,
                src_blocks,
                src_slot,
                reply,
                receiver.layout,
                addresses,
            )
        self.backend.send(channel, self._peer, request_id, copies, channel.time_left(self.timeout))
        nbytes = sum(
            n
            for c in copies
            for _, _, n in c.byte_ranges(self.backend.pools.region(c.kind, c.src).nbytes)
        )
        if send.shards is not None:
            nbytes += send.shards.result()  # raises what a shard send raised
        channel.send(TransferDone(request_id))
        ack = channel.receive(self.timeout, max_bytes=CONTROL_MAX_BYTES)
        if not isinstance(ack, TransferAck) or ack.request_id != request_id:
            raise TransferFailed(f"request {request_id}: expected TransferAck, got {ack!r}")
        sent = sum(1 for c in copies if c.kind == "kv")
        return SendOutcome(request_id, "acked", "", sent, reply.held_blocks, nbytes)

    def _release(self, request_id: str, status: str, detail: str, *, now: bool) -> SendOutcome:
        if now:
            with self.lock:
                self.prefill.release_handoff(
                    request_id, status if not detail else f"{status}: {detail}"
                )
        if status != "acked":
            logger.warning("request %s: transfer %s (%s)", request_id, status, detail)
        return SendOutcome(request_id, status, detail)

    def close_link(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._peer:
            self.backend.remove_peer(self._peer)
            self._peer = ""


__all__ = [
    "DecodePort",
    "Pools",
    "PrefillPort",
    "SendOutcome",
    "TransferReceiver",
    "TransferSender",
]
