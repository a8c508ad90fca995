"""Backend wrappers that fail on purpose, for fault tests of everything above the backend."""

from __future__ import annotations

import time

from hybridserve.transceiver.base import RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed


class WrappedBackend(TransferBackend):
    """A real backend behind a test double: everything passes through to `inner` unless a
    subclass overrides `send` / `receive`."""

    def __init__(self, inner: TransferBackend) -> None:
        super().__init__(inner.pools)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]

    def local_info(self) -> bytes:
        return self.inner.local_info()

    def add_peer(self, info: bytes) -> str:
        return self.inner.add_peer(info)

    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        self.inner.send(channel, peer, request_id, copies, timeout)

    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        self.inner.receive(channel, peer, request_id, copies, timeout)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def close(self) -> None:
        self.inner.close()


class FaultInjectingBackend(WrappedBackend):
    """Wraps a real backend: every `fail_every`-th send / receive raises TransferFailed (0 =
    never), and each one first sleeps `delay_seconds` (to provoke timeouts)."""

    def __init__(
        self, inner: TransferBackend, *, fail_every: int = 0, delay_seconds: float = 0.0
    ) -> None:
        super().__init__(inner)
        self.fail_every = fail_every
        self.delay_seconds = delay_seconds
        self.operations = 0

    def _maybe_fail(self, request_id: str) -> None:
        self.operations += 1
        if self.delay_seconds:
            time.sleep(self.delay_seconds)
        if self.fail_every and self.operations % self.fail_every == 0:
            raise TransferFailed(
                f"request {request_id}: injected fault (operation "
                f"{self.operations}, every {self.fail_every})"
            )

    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        self._maybe_fail(request_id)
        super().send(channel, peer, request_id, copies, timeout)

    def receive(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        self._maybe_fail(request_id)
        super().receive(channel, peer, request_id, copies, timeout)
