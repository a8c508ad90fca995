"""A framed control channel over one TCP socket: msgpack messages and raw byte payloads.

    frame := 4-byte big-endian length | msgpack message (protocol.encode)
    bytes are sent as they are, right after the message that announces their length

Every receive has a deadline; a closed peer, a timeout or a malformed frame raises
`TransferFailed` with what happened, never a half-read message.
"""

from __future__ import annotations

import contextlib
import socket
import struct

from hybridserve.transceiver.protocol import MAX_MESSAGE_BYTES, Message, decode, encode

_LENGTH = struct.Struct(">I")


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

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
