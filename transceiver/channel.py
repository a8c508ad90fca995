"""A framed control channel over one TCP socket: msgpack messages and raw byte payloads.

    frame := 4-byte big-endian length | msgpack message (protocol.encode)
    bytes are sent as they are, right after the message that announces their length

Every read and write has a timeout (inactivity) and, inside `deadline()`, a total deadline as
well, so a peer that trickles bytes cannot stretch a transfer without end; every receive takes
the largest message it accepts at that point of the exchange, checked before anything of that
size is allocated. A closed peer, a timeout or a malformed frame raises `TransferFailed` with
what happened, never a half-read message.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

from hybridserve.transceiver.protocol import MAX_MESSAGE_BYTES, Message, decode, encode

_LENGTH = struct.Struct(">I")
# Links one listener serves at once: the engines of a deployment with room to spare (a prefill
# engine opens up to 16 links to each decode engine, transfer_links_per_peer; 8 by default).
MAX_LINKS = 256
logger = logging.getLogger(__name__)


class TransferFailed(ConnectionError):
    """The peer or the link failed mid-transfer (closed, timed out, spoke garbage)."""


class Channel:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self._deadline: float | None = None  # monotonic seconds, inside `deadline()`
        self._deadline_seconds = 0.0
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

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Every read and write inside ends within `seconds` from now, all of them together."""
        self._deadline, self._deadline_seconds = time.monotonic() + seconds, seconds
        try:
            yield
        finally:
            self._deadline = None

    def time_left(self, timeout: float | None = None) -> float:
        """How long the next read or write may wait: `timeout` (the channel's by default), cut
        to what is left of the deadline; raises TransferFailed once the deadline has passed."""
        timeout = self.timeout if timeout is None else timeout
        if self._deadline is None:
            return timeout
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransferFailed(
                f"the transfer did not finish within its {self._deadline_seconds} s deadline"
            )
        return min(timeout, left)

    def send_bytes(self, data: bytes | memoryview) -> None:
        try:
            # NOTE: since Python 3.5 a socket timeout bounds the whole sendall, not each send.
            self.sock.settimeout(self.time_left())
            self.sock.sendall(data)
        except TimeoutError as exc:
            raise TransferFailed(self._timed_out(self.timeout)) from exc
        except OSError as exc:
            raise TransferFailed(f"send to transfer peer failed: {exc}") from exc

    def receive(
        self, timeout: float | None = None, *, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> Message:
        """The next message; `max_bytes`: the largest this point of the exchange accepts (a
        bigger announced length fails the link before anything is allocated for it)."""
        header = bytearray(_LENGTH.size)
        self.receive_into(memoryview(header), timeout)
        (length,) = _LENGTH.unpack(header)
        if length > max_bytes:
            raise TransferFailed(
                f"peer announced a {length}-byte message where at most {max_bytes} bytes are "
                "accepted: not our protocol, or not at this point of a transfer"
            )
        payload = bytearray(length)
        self.receive_into(memoryview(payload), timeout)
        try:
            return decode(bytes(payload))
        except ValueError as exc:
            raise TransferFailed(f"malformed message from transfer peer: {exc}") from exc

    def receive_into(self, view: memoryview, timeout: float | None = None) -> None:
        """Fill `view` completely from the socket (zero-copy into the destination)."""
        received = 0
        try:
            while received < len(view):
                self.sock.settimeout(self.time_left(timeout))
                count = self.sock.recv_into(view[received:])
                if count == 0:
                    raise TransferFailed("transfer peer closed the connection")
                received += count
        except TimeoutError as exc:
            raise TransferFailed(
                self._timed_out(self.timeout if timeout is None else timeout)
            ) from exc
        except OSError as exc:
            raise TransferFailed(f"receive from transfer peer failed: {exc}") from exc

    def _timed_out(self, timeout: float) -> str:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return f"the transfer did not finish within its {self._deadline_seconds} s deadline"
        return f"transfer peer sent nothing for {timeout} s"

    def next_message(
        self, stop: threading.Event, poll: float = 0.5, *, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> Message | None:
        """The next message on a link that may stay idle between transfers (then read within
        the channel's timeout); None once `stop` is set."""
        while not stop.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], poll)
            except (OSError, ValueError) as exc:  # closed under us
                raise TransferFailed(f"transfer link closed: {exc}") from exc
            if readable:
                return self.receive(max_bytes=max_bytes)
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
