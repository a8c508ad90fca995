"""The links' challenge–response over a real loopback connection: peers that share the secret
admit each other; a wrong secret, a replayed proof or a malformed one is refused, on either
side, before the peer's Hello is acted on."""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from hybridserve.transceiver.auth import AcceptedHello, PeerAuth, Unauthenticated, new_secret
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import Challenge, Hello, TransferError
from tests.transceiver.test_protocol import LAYOUT

SECRET, OTHER = new_secret(), new_secret()


def hello(layout: PeerLayout = LAYOUT, info: bytes = b"") -> Hello:
    return Hello(layout, "tcp", info)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `call` on a thread; the dict gets its "result" or its "error"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def accept_and_answer(auth: PeerAuth, channel: Channel) -> Hello:
    accepted = auth.accept(channel)
    auth.answer(channel, accepted, hello(info=b"accepting side"))
    return accepted.hello


def test_peers_with_the_same_secret_admit_each_other(pair):
    client, server = pair
    thread, accepted = in_thread(lambda: accept_and_answer(PeerAuth(SECRET), server))
    reply = PeerAuth(bytes.fromhex(SECRET)).connect(client, hello(info=b"connecting side"))
    thread.join(5)
    assert reply.backend_info == b"accepting side"
    assert accepted["result"].backend_info == b"connecting side"
    assert accepted["result"].layout == LAYOUT


def test_a_connecting_peer_with_another_secret_is_refused_and_told(pair):
    client, server = pair
    thread, accepted = in_thread(lambda: accept_and_answer(PeerAuth(SECRET), server))
    with pytest.raises(Unauthenticated, match="could not prove that it belongs"):
        PeerAuth(OTHER).connect(client, hello())
    thread.join(5)
    assert isinstance(accepted["error"], Unauthenticated)


def test_an_accepting_peer_with_another_secret_is_refused_by_the_connecting_side(pair):
    """An impostor listener learns nothing: the connecting side checks its proof before it
    sends anything beyond its Hello."""
    client, server = pair
    # The impostor does not check the connecting side's proof; it just answers.
    impostor = PeerAuth(OTHER)

    def answer_anyway() -> None:
        nonce = b"\x07" * 16
        server.send(Challenge(nonce))
        theirs = server.receive()
        assert isinstance(theirs, Hello)
        impostor.answer(server, AcceptedHello(theirs, nonce), hello())

    thread, _ = in_thread(answer_anyway)
    with pytest.raises(Unauthenticated, match="transfer peer could not prove"):
        PeerAuth(SECRET).connect(client, hello())
    thread.join(5)


def test_a_replayed_hello_is_refused(pair):
    """A recorded Hello answers another link's challenge: the fresh nonce makes it worthless."""
    client, server = pair
    recorded: list[Hello] = []

    def record() -> None:
        accepted = PeerAuth(SECRET).accept(server)
        recorded.append(accepted.hello)
        PeerAuth(SECRET).answer(server, accepted, hello())

    thread, _ = in_thread(record)
    PeerAuth(SECRET).connect(client, hello())
    thread.join(5)

    server2 = socket.create_server(("127.0.0.1", 0))
    attacker = Channel.connect(server2.getsockname()[:2], timeout=2.0)
    sock, _ = server2.accept()
    listener = Channel(sock, timeout=2.0)
    try:
        thread, accepted = in_thread(lambda: PeerAuth(SECRET).accept(listener))
        assert isinstance(attacker.receive(), Challenge)  # a new nonce: the replay ignores it
        attacker.send(recorded[0])
        refusal = attacker.receive()
        thread.join(5)
        assert isinstance(refusal, TransferError) and refusal.code == "unauthenticated"
        assert isinstance(accepted["error"], Unauthenticated)
    finally:
        attacker.close()
        listener.close()
        server2.close()


@pytest.mark.parametrize(
    "change",
    [
        {"proof": b""},
        {"proof": "not bytes"},
        {"proof": b"\x00" * 32},
        {"nonce": 12345},
        {"nonce": b"short"},
    ],
    ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}",
)
def test_a_malformed_or_missing_proof_is_refused(pair, change):
    client, server = pair
    thread, accepted = in_thread(lambda: PeerAuth(SECRET).accept(server))
    assert isinstance(client.receive(), Challenge)
    client.send(dataclasses.replace(hello(), **change))
    refusal = client.receive()
    thread.join(5)
    assert isinstance(refusal, TransferError) and refusal.code == "unauthenticated"
    assert isinstance(accepted["error"], Unauthenticated)


def test_an_unauthenticated_peer_cannot_make_the_listener_allocate_a_large_message(pair):
    client, server = pair
    thread, accepted = in_thread(lambda: PeerAuth(SECRET).accept(server))
    assert isinstance(client.receive(), Challenge)
    client.send_bytes((64 << 20).to_bytes(4, "big"))  # a 64 MiB Hello, announced
    thread.join(5)
    error = accepted["error"]
    assert isinstance(error, TransferFailed) and not isinstance(error, Unauthenticated)
    assert "at most 1048576 bytes are accepted" in str(error)


@pytest.mark.parametrize("secret", ["ab" * 8 + "a", "zz" * 16, "ab" * 15, b"\x01" * 15])
def test_a_short_or_malformed_secret_is_refused(secret):
    with pytest.raises(ValueError):
        PeerAuth(secret)
