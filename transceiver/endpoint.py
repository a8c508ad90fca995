"""The two ends of a transfer link: a sender next to a prefill engine, a receiver next to a
decode engine. Each drives its engine through a small port (duck-typed; the transceiver does
not import the engine) under the caller's lock, since the engine's own loop steps in parallel.

    sender (prefill)                             receiver (decode)
    connect: Hello ------------------------->    check layout / hash, add peer
             <-------------------------- Hello   (or TransferError: layout_mismatch)
    send(handoff): TransferRequest -------->    engine.prepare_receive
             <-- ReceivePlan | TransferError     (rejections hold nothing)
    backend.send (regions)  ------ bytes ---->   backend.receive into the plan's destinations
    TransferDone ---------------------------->   engine.complete_receive
             <------------------- TransferAck    (any failure: engine.fail_receive)
    engine.release_handoff("acked")

A failure on the link closes it (its state is unknown); the sender reconnects for the next
request. The prefill side frees a failed handoff at once when its backend guarantees no read
is still in flight (TCP), otherwise at lease expiry.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from hybridserve.transceiver.base import Pools, RegionCopy, TransferBackend, region_copies
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.layout import LayoutMismatch, PeerLayout, check_compatible
from hybridserve.transceiver.protocol import (
    Hello,
    ReceivePlan,
    TransferAbort,
    TransferAck,
    TransferDone,
    TransferError,
    TransferRequest,
)

logger = logging.getLogger(__name__)


class PrefillPort(Protocol):
    def handoff_source(self, request_id: str) -> tuple[list[int], int] | None: ...

    def release_handoff(self, request_id: str, reason: str) -> bool: ...


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


def _handshake_reply(channel: Channel, layout: PeerLayout, backend: TransferBackend) -> str:
    """Receiver half of the handshake; returns the peer's backend handle."""
    hello = channel.receive()
    if not isinstance(hello, Hello):
        raise TransferFailed(f"expected a Hello from the transfer peer, got {hello.type}")
    try:
        if hello.backend != backend.name:
            raise LayoutMismatch(
                f"peer uses transfer backend {hello.backend!r}, this engine "
                f"{backend.name!r}: both sides must use the same one"
            )
        check_compatible(layout, hello.layout)
    except LayoutMismatch as exc:
        channel.send(TransferError("", "layout_mismatch", str(exc)))
        raise
    peer = backend.add_peer(hello.backend_info)
    channel.send(Hello(layout, backend.name, backend.local_info()))
    return peer


class TransferReceiver:
    """Accepts prefill peers on a TCP port and lands their transfers in a decode engine."""

    def __init__(
        self,
        engine: DecodePort,
        layout: PeerLayout,
        backend: TransferBackend,
        *,
        lock: threading.Lock,
        host: str,
        port: int = 0,
        timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.backend = backend
        self.lock = lock
        self.timeout = timeout
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name="transfer-receiver", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._serve,
                args=(Channel(sock, self.timeout),),
                name="transfer-link",
                daemon=True,
            ).start()

    def _serve(self, channel: Channel) -> None:
        peer = ""
        try:
            peer = _handshake_reply(channel, self.layout, self.backend)
            while not self._stop.is_set():
                try:
                    message = channel.receive(timeout=0.5)
                except TransferFailed as exc:
                    if "sent nothing" in str(exc):
                        continue  # idle link
                    raise
                if isinstance(message, TransferRequest):
                    self._receive(channel, peer, message)
                elif isinstance(message, TransferAbort):
                    with self.lock:
                        self.engine.fail_receive(
                            message.request_id, message.reason, writer_done=True
                        )
        except (TransferFailed, LayoutMismatch) as exc:
            logger.info("transfer link closed: %s", exc)
        finally:
            if peer:
                self.backend.remove_peer(peer)
            channel.close()

    def _receive(self, channel: Channel, peer: str, message: TransferRequest) -> None:
        request_id = message.request_id
        with self.lock:
            try:
                plan = self.engine.prepare_receive(message)
            except ValueError as exc:
                channel.send(TransferError(request_id, getattr(exc, "code", "rejected"), str(exc)))
                return
        channel.send(plan)
        copies = [
            RegionCopy(c.kind, -1, c.dst)
            for c in region_copies(
                self.backend.pools, [-1] * (plan.held_blocks + len(plan.dst_block_ids)), -1, plan
            )
        ]
        try:
            self.backend.receive(channel, peer, request_id, copies, self.timeout)
            done = channel.receive(self.timeout)
            if isinstance(done, TransferAbort):
                raise TransferFailed(f"sender aborted: {done.reason}")
            if not isinstance(done, TransferDone) or done.request_id != request_id:
                raise TransferFailed(f"request {request_id}: expected TransferDone, got {done!r}")
        except TransferFailed as exc:
            with self.lock:
                # A TCP link is the only writer: once it failed nothing else can land. NIXL
                # writes come from the peer's NIC, so those pages wait in quarantine.
                self.engine.fail_receive(
                    request_id, str(exc), writer_done=self.backend.name == "tcp"
                )
            raise
        with self.lock:
            try:
                self.engine.complete_receive(request_id)
            except ValueError as exc:  # aborted here while its data was arriving
                channel.send(TransferError(request_id, getattr(exc, "code", "rejected"), str(exc)))
                return
        channel.send(TransferAck(request_id))

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(timeout=2)


class TransferSender:
    """Sends a prefill engine's handoffs to one decode peer."""

    def __init__(
        self,
        engine: PrefillPort,
        layout: PeerLayout,
        backend: TransferBackend,
        peer_address: tuple[str, int],
        *,
        lock: threading.Lock,
        timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.backend = backend
        self.peer_address = peer_address
        self.lock = lock
        self.timeout = timeout
        self._channel: Channel | None = None
        self._peer = ""

    def connect(self) -> None:
        """Open the link and check the peer's layout (LayoutMismatch if incompatible)."""
        channel = Channel.connect(self.peer_address, self.timeout)
        try:
            channel.send(Hello(self.layout, self.backend.name, self.backend.local_info()))
            reply = channel.receive()
            if isinstance(reply, TransferError):
                raise LayoutMismatch(reply.message)
            if not isinstance(reply, Hello):
                raise TransferFailed(f"expected a Hello from the decode peer, got {reply.type}")
            check_compatible(self.layout, reply.layout)
            self._peer = self.backend.add_peer(reply.backend_info)
        except BaseException:
            channel.close()
            raise
        self._channel = channel

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
        data_started = False
        try:
            channel.send(message)
            reply = channel.receive(self.timeout)
            if isinstance(reply, TransferError):
                return self._release(
                    request_id, "rejected", f"{reply.code}: {reply.message}", now=True
                )
            if not isinstance(reply, ReceivePlan) or reply.request_id != request_id:
                raise TransferFailed(f"request {request_id}: expected a ReceivePlan, got {reply!r}")
            with self.lock:
                source = self.engine.handoff_source(request_id)
            if source is None:
                raise TransferFailed(
                    f"request {request_id}: the handoff was released (lease "
                    "expired or aborted) before its data was sent"
                )
            src_blocks, src_slot = source
            copies = region_copies(self.backend.pools, src_blocks, src_slot, reply)
            data_started = True
            self.backend.send(channel, self._peer, request_id, copies, self.timeout)
            channel.send(TransferDone(request_id))
            ack = channel.receive(self.timeout)
            if not isinstance(ack, TransferAck) or ack.request_id != request_id:
                raise TransferFailed(f"request {request_id}: expected TransferAck, got {ack!r}")
            sent = sum(1 for c in copies if c.kind == "kv")
            nbytes = sum(self.backend.pools.region(c.kind, c.src).nbytes for c in copies)
        except TransferFailed as exc:
            with contextlib.suppress(TransferFailed):
                channel.send(TransferAbort(request_id, str(exc)))
            self.close_link()
            safe = not data_started or self.backend.name == "tcp"
            return self._release(request_id, "failed", str(exc), now=safe)
        self._release(request_id, "acked", "", now=True)
        return SendOutcome(request_id, "acked", "", sent, reply.held_blocks, nbytes)

    def _release(self, request_id: str, status: str, detail: str, *, now: bool) -> SendOutcome:
        if now:
            with self.lock:
                self.engine.release_handoff(
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
