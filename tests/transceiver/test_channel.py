"""The framed control channel over a real loopback TCP connection: messages and large raw
payloads arrive intact, and a closed peer, a silent peer or a peer speaking garbage raises
TransferFailed saying which, never a half-read message or a hang."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from hybridserve.transceiver.channel import Channel, Listener, TransferFailed
from hybridserve.transceiver.protocol import (
    MAX_MESSAGE_BYTES,
    DataFrame,
    ReceivePlan,
    TransferAbort,
    TransferDone,
    TransferError,
)


def in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_messages_round_trip_both_ways_in_order(pair):
    client, server = pair
    sent = [
        ReceivePlan("r1", held_blocks=1, dst_block_ids=[7, 2], dst_slot=0),
        TransferDone("r1"),
        TransferError("r2", "no_capacity", "later"),
    ]
    for message in sent:
        client.send(message)
    assert [server.receive() for _ in sent] == sent
    server.send(TransferAbort("r1", "bye"))
    assert client.receive() == TransferAbort("r1", "bye")


def test_large_payloads_arrive_byte_exact_after_their_header(pair):
    """32 MiB raw, far more than the socket buffers: the sender blocks until the receiver
    drains, and `receive_into` fills the destination completely, in order."""
    client, server = pair
    size = 32 << 20
    payload = bytes(range(251)) * (size // 251) + b"\x07" * (size % 251)
    sender = in_thread(
        lambda: (
            client.send(DataFrame("r", "kv", dst=3, nbytes=size)),
            client.send_bytes(memoryview(payload)),
            client.send(TransferDone("r")),
        )
    )
    frame = server.receive()
    assert frame == DataFrame("r", "kv", dst=3, nbytes=size)
    destination = bytearray(size)
    server.receive_into(memoryview(destination))
    assert server.receive() == TransferDone("r")
    sender.join(timeout=10)
    assert destination == payload


def test_a_peer_that_closes_raises_transfer_failed(pair):
    client, server = pair
    client.close()
    with pytest.raises(TransferFailed, match="transfer peer closed the connection"):
        server.receive()


def test_a_peer_that_closes_mid_frame_never_yields_a_partial_message(pair):
    client, server = pair
    payload = b"\x81\xa1v\x03"  # a valid start of a message ...
    client.send_bytes(struct.pack(">I", 100) + payload)  # ... announced as 100 bytes
    client.close()
    with pytest.raises(TransferFailed, match="closed the connection"):
        server.receive()


def test_a_peer_that_closes_mid_payload_raises(pair):
    client, server = pair
    client.send_bytes(b"\x01" * 1000)
    client.close()
    destination = bytearray(4096)
    with pytest.raises(TransferFailed, match="closed the connection"):
        server.receive_into(memoryview(destination))
    assert destination[:1000] == b"\x01" * 1000  # what arrived, but never reported as complete


def test_sending_to_a_closed_peer_raises_transfer_failed(pair):
    client, server = pair
    server.close()
    # The first writes may still be buffered locally; the reset surfaces within a few.
    with pytest.raises(TransferFailed, match="send to transfer peer failed"):
        for _ in range(200):
            client.send_bytes(b"\x00" * 65536)
            time.sleep(0.001)


def test_a_silent_peer_times_out_with_the_deadline_in_the_message(pair):
    _, server = pair
    start = time.monotonic()
    with pytest.raises(TransferFailed, match=r"transfer peer sent nothing for 0\.2 s"):
        server.receive(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0


def test_the_channel_timeout_is_the_default_deadline():
    server = socket.create_server(("127.0.0.1", 0))
    client = Channel.connect(server.getsockname()[:2], timeout=0.15)
    accepted, _ = server.accept()
    try:
        start = time.monotonic()
        with pytest.raises(TransferFailed, match=r"sent nothing for 0\.15 s"):
            client.receive()
        assert 0.15 <= time.monotonic() - start < 2.0
        # A per-call deadline overrides it, and the next call is back to the default.
        accepted.sendall(b"\x00\x00")  # half a length header, then silence
        with pytest.raises(TransferFailed, match=r"sent nothing for 0\.3 s"):
            client.receive(timeout=0.3)
        assert client.sock.gettimeout() == 0.3
        with pytest.raises(TransferFailed, match=r"sent nothing for 0\.15 s"):
            client.receive_into(memoryview(bytearray(1)))
    finally:
        client.close()
        accepted.close()
        server.close()


def test_a_timeout_mid_payload_raises_instead_of_returning_short(pair):
    client, server = pair
    client.send_bytes(b"\x02" * 10)
    with pytest.raises(TransferFailed, match="sent nothing for"):
        server.receive_into(memoryview(bytearray(20)), timeout=0.2)


def test_an_oversized_frame_is_refused_without_reading_it(pair):
    client, server = pair
    client.send_bytes(struct.pack(">I", MAX_MESSAGE_BYTES + 1))
    start = time.monotonic()
    with pytest.raises(TransferFailed, match=f"{MAX_MESSAGE_BYTES + 1}-byte message .*not our"):
        server.receive(timeout=5.0)
    assert time.monotonic() - start < 1.0  # refused at the header, not after a read attempt


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (b"\xc1\xc1\xc1", "not a msgpack message"),
        (b"\x93\x01\x02\x03", "expected a message object"),
        (b"\x82\xa1v\x09\xa4type\xa4done", "protocol version 9"),
        (b"\x82\xa1v\x08\xa4type\xa4exec", "unknown message type 'exec'"),
    ],
)
def test_a_malformed_frame_raises_transfer_failed_naming_the_problem(pair, body, shown):
    client, server = pair
    client.send_bytes(struct.pack(">I", len(body)) + body)
    with pytest.raises(TransferFailed, match="malformed message from transfer peer") as info:
        server.receive()
    assert shown in str(info.value)


def test_connecting_to_nobody_raises_transfer_failed():
    probe = socket.create_server(("127.0.0.1", 0))
    address = probe.getsockname()[:2]
    probe.close()  # nothing listens there now
    with pytest.raises(TransferFailed, match=f"cannot reach transfer peer 127.0.0.1:{address[1]}"):
        Channel.connect(address, timeout=1.0)


def test_close_is_idempotent(pair):
    client, _ = pair
    client.close()
    client.close()
    with pytest.raises(TransferFailed):
        client.send(TransferDone("r"))


def test_an_idle_link_waits_past_the_channel_timeout_until_a_message_or_stop(pair):
    """A link between transfers may stay silent far longer than the read deadline: next_message
    keeps waiting, returns the message once it comes, and returns None once stopped."""
    client, server = pair
    server.sock.settimeout(0.1)
    server.timeout = 0.1
    stop = threading.Event()
    threading.Timer(0.5, client.send, args=(TransferDone("late"),)).start()
    assert server.next_message(stop, poll=0.05) == TransferDone("late")
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    assert server.next_message(stop, poll=0.05) is None
    assert 0.25 <= time.monotonic() - start < 2.0


def test_next_message_on_a_closed_peer_raises(pair):
    client, server = pair
    client.close()
    with pytest.raises(TransferFailed, match="closed the connection"):
        server.next_message(threading.Event(), poll=0.05)


def test_a_listener_serves_each_link_on_its_own_thread_until_closed():
    received: list[TransferDone] = []
    both_in = threading.Barrier(3, timeout=5)

    def serve(channel: Channel) -> None:
        both_in.wait()  # two links are served at once, not one after the other
        received.append(channel.receive())
        channel.close()

    listener = Listener("127.0.0.1", serve, timeout=5.0, name="test-listener")
    links = [Channel.connect(listener.address, timeout=5.0) for _ in range(2)]
    both_in.wait()
    for index, link in enumerate(links):
        link.send(TransferDone(f"r{index}"))
    deadline = time.monotonic() + 5
    while len(received) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(message.request_id for message in received) == ["r0", "r1"]
    listener.close()
    assert listener.stopped.is_set()
    with pytest.raises(TransferFailed):
        Channel.connect(listener.address, timeout=1.0)
    for link in links:
        link.close()


def test_a_listener_closes_links_beyond_its_cap_and_serves_again_once_one_ends():
    release = threading.Event()
    served: list[str] = []

    def serve(channel: Channel) -> None:
        served.append(channel.receive().request_id)
        release.wait(5)
        channel.close()

    listener = Listener("127.0.0.1", serve, timeout=5.0, name="test-listener", max_links=2)
    links = [Channel.connect(listener.address, timeout=5.0) for _ in range(2)]
    for index, link in enumerate(links):
        link.send(TransferDone(f"r{index}"))
    deadline = time.monotonic() + 5
    while len(served) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    extra = Channel.connect(listener.address, timeout=5.0)
    with pytest.raises(TransferFailed, match="closed the connection"):
        extra.receive(timeout=5.0)  # closed at accept: the cap holds
    release.set()  # the two links end
    deadline = time.monotonic() + 5
    while True:  # a link is served again once a slot is free
        again = Channel.connect(listener.address, timeout=5.0)
        again.send(TransferDone("r2"))
        time.sleep(0.1)
        if "r2" in served or time.monotonic() > deadline:
            break
        again.close()
    assert "r2" in served
    listener.close()
    for link in [*links, extra, again]:
        link.close()
