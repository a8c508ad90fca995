"""A framed control channel over one TCP socket: msgpack messages and raw byte payloads.

    frame := 4-byte big-endian length | msgpack message (protocol.encode)
    bytes are sent as they are, right after the message that announces their length

Every receive has a deadline; a closed peer, a timeout or a malformed frame raises
`TransferFailed` with what happened, never a half-read message.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable

from hybridserve.transceiver.protocol import MAX_MESSAGE_BYTES, Message, decode, encode

_LENGTH = struct.Struct(">I")
# Links one listener serves at once: the engines of a deployment, with room to spare.
MAX_LINKS = 64
logger = logging.getLogger(__name__)


class TransferFailed(ConnectionError):
    """The peer or the link failed mid-transfer (closed, timed out, spoke garbage)."""


class Channel:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, address: tuple[str, int], timeout: float) -> Channel:
        try:
            return cls(socket.create_connection(address, timeout=timeout), timeout)
        except OSError as exc:
            raise TransferFailed(
                f"cannot reach transfer peer {address[0]}:{address[1]}: {exc}"
            ) from exc

    def send(self, message: Message) -> None:
        payload = encode(message)
        self.send_bytes(_LENGTH.pack(len(payload)) + payload)

    def send_bytes(self, data: bytes | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise TransferFailed(f"send to transfer peer failed: {exc}") from exc

    def receive(self, timeout: float | None = None) -> Message:
        header = bytearray(_LENGTH.size)
        self.receive_into(memoryview(header), timeout)
        (length,) = _LENGTH.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            raise TransferFailed(
                f"peer announced a {length}-byte message (limit "
                f"{MAX_MESSAGE_BYTES}): not our protocol"
            )
        payload = bytearray(length)
        self.receive_into(memoryview(payload), timeout)
        try:
            return decode(bytes(payload))
        except ValueError as exc:
            raise TransferFailed(f"malformed message from transfer peer: {exc}") from exc

    def receive_into(self, view: memoryview, timeout: float | None = None) -> None:
        """Fill `view` completely from the socket (zero-copy into the destination)."""
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        received = 0
        try:
            while received < len(view):
                count = self.sock.recv_into(view[received:])
                if count == 0:
                    raise TransferFailed("transfer peer closed the connection")
                received += count
        except TimeoutError as exc:
            raise TransferFailed(
                f"transfer peer sent nothing for {self.sock.gettimeout()} s"
            ) from exc
        except OSError as exc:
            raise TransferFailed(f"receive from transfer peer failed: {exc}") from exc

    def next_message(self, stop: threading.Event, poll: float = 0.5) -> Message | None:
        """The next message on a link that may stay idle between transfers (then read within
        the channel's timeout); None once `stop` is set."""
        while not stop.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], poll)
            except (OSError, ValueError) as exc:  # closed under us
                raise TransferFailed(f"transfer link closed: {exc}") from exc
            if readable:
                return self.receive()
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Listener:
    """Accepts links on a TCP port (`address`), each served by `serve(channel)` on a thread of
    its own, until `close`. At most `max_links` are served at once: a link beyond them is
    closed at accept (a peer that opens connections without end cannot exhaust threads)."""

    def __init__(
        self,
        host: str,
        serve: Callable[[Channel], None],
        *,
        timeout: float,
        name: str,
        port: int = 0,
        max_links: int = MAX_LINKS,
    ) -> None:
        self.serve = serve
        self.timeout = timeout
        self.name = name
        self.max_links = max_links
        self._links = threading.BoundedSemaphore(max_links)
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                sock, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._links.acquire(blocking=False):
                logger.warning(
                    "%s: refused a link from %s: %d links are served already",
                    self.name,
                    peer,
                    self.max_links,
                )
                sock.close()
                continue
            threading.Thread(
                target=self._serve_link,
                args=(Channel(sock, self.timeout),),
                name=f"{self.name}-link",
                daemon=True,
            ).start()

    def _serve_link(self, channel: Channel) -> None:
        try:
            self.serve(channel)
        finally:
            self._links.release()

    def close(self) -> None:
        self.stopped.set()
        self._server.close()
        self._thread.join(timeout=2)
