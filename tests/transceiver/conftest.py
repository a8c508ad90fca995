"""Fixtures of the transceiver tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from hybridserve.transceiver.channel import Channel


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    """(client, server) channels over one loopback TCP connection, 5 s default timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    client = Channel.connect(server.getsockname()[:2], timeout=5.0)
    accepted, _ = server.accept()
    server.close()
    peer = Channel(accepted, timeout=5.0)
    yield client, peer
    client.close()
    peer.close()
