"""NIXL streams: a transfer cut into parts, each written from its own thread and UCX worker,
lands byte for byte whatever stream counts the two sides use."""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch

from hybridserve.transceiver.base import Pools, RegionCopy
from hybridserve.transceiver.channel import TransferFailed

nixl_backend = pytest.importorskip(
    "hybridserve.transceiver.nixl_backend", reason="the nixl package is not installed here"
)
pytest.importorskip("nixl._api", reason="the nixl package is not installed here")
NixlBackend, split_parts = nixl_backend.NixlBackend, nixl_backend.split_parts

NUM_REGIONS = 12
REGION_BYTES = 4096


def copies(pairs: list[tuple[int, int]]) -> list[RegionCopy]:
    return [RegionCopy("kv", src, dst) for src, dst in pairs]


@pytest.mark.parametrize(
    ("num_copies", "num_streams", "sizes"),
    [(0, 2, []), (1, 4, [1]), (7, 1, [7]), (7, 2, [3, 4]), (7, 3, [2, 2, 3]), (2, 8, [1, 1])],
)
def test_parts_are_contiguous_runs_of_near_equal_size(num_copies, num_streams, sizes):
    all_copies = copies([(i, i) for i in range(num_copies)])
    parts = split_parts(all_copies, num_streams)
    assert [len(p) for p in parts] == sizes
    assert [c for part in parts for c in part] == all_copies


def make_backend(num_streams: int, seed: int | None) -> NixlBackend:
    pool = torch.zeros(NUM_REGIONS, REGION_BYTES, dtype=torch.uint8)
    if seed is not None:
        pool.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return NixlBackend(Pools({"kv": pool}), num_streams)


@pytest.mark.parametrize(("sender_streams", "receiver_streams"), [(1, 2), (2, 1), (3, 2)])
def test_every_region_lands_whatever_the_stream_counts(sender_streams, receiver_streams):
    sender, receiver = make_backend(sender_streams, seed=7), make_backend(receiver_streams, None)
    try:
        to_receiver = sender.add_peer(receiver.local_info())
        from_sender = receiver.add_peer(sender.local_info())
        # Scattered destinations; region 11 of the receiver must stay untouched.
        pairs = [(0, 5), (1, 2), (2, 9), (3, 0), (4, 7), (5, 1), (6, 10)]
        errors: list[BaseException] = []

        def send() -> None:
            try:
                sender.send(None, to_receiver, "req-1", copies(pairs), timeout=10)
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        receiver.receive(None, from_sender, "req-1", copies(pairs), timeout=10)
        thread.join(10)
        assert errors == [] and not thread.is_alive()
        src, dst = sender.pools.tensors["kv"], receiver.pools.tensors["kv"]
        for s, d in pairs:
            assert torch.equal(dst[d], src[s]), (s, d)
        assert not dst[11].any()
    finally:
        sender.close()
        receiver.close()


def test_a_peer_without_a_stream_count_is_refused():
    a, b = make_backend(1, None), make_backend(2, None)
    try:
        info = msgpack.unpackb(b.local_info(), raw=False)
        info["streams"] = 0
        with pytest.raises(TransferFailed, match="stream count 0"):
            a.add_peer(msgpack.packb(info, use_bin_type=True))
    finally:
        a.close()
        b.close()


def test_a_stream_count_below_one_is_an_error():
    with pytest.raises(ValueError, match="num_streams must be >= 1"):
        make_backend(0, None)


def test_a_failed_part_fails_the_send_once_every_part_has_ended(monkeypatch):
    sender, receiver = make_backend(2, seed=7), make_backend(2, None)
    try:
        to_receiver = sender.add_peer(receiver.local_info())
        from_sender = receiver.add_peer(sender.local_info())
        pairs = copies([(i, i) for i in range(6)])
        write, ended = sender._write, []

        def fail_first_part(peer, request_id, part, tag, deadline):
            if tag.endswith(b"#0/2"):
                raise TransferFailed("injected: part 0 failed")
            write(peer, request_id, part, tag, deadline)
            ended.append(tag)

        monkeypatch.setattr(sender, "_write", fail_first_part)
        # The receiver polls meanwhile (its progress completes the sender's writes), and
        # never sees part 0's notification: a clear timeout naming the part.
        received: list[BaseException] = []

        def receive() -> None:
            try:
                receiver.receive(None, from_sender, "req-2", pairs, timeout=3)
            except TransferFailed as exc:
                received.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        with pytest.raises(TransferFailed, match="injected"):
            sender.send(None, to_receiver, "req-2", pairs, timeout=10)
        assert ended == [b"req-2#1/2"]  # the healthy part finished before the send raised
        thread.join(10)
        assert len(received) == 1 and "part 1 of 2" in str(received[0])
        assert torch.equal(
            receiver.pools.tensors["kv"][3:6], sender.pools.tensors["kv"][3:6]
        )  # part 1 landed
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def linked():
    """A sender and a receiver with 2 streams each, introduced to one another."""
    sender, receiver = make_backend(2, seed=3), make_backend(2, None)
    to_receiver = sender.add_peer(receiver.local_info())
    from_sender = receiver.add_peer(sender.local_info())
    yield sender, receiver, to_receiver, from_sender
    sender.close()
    receiver.close()


def send_while_receiving(linked, send_id: str, receive_id: str, pairs, timeout: float) -> list:
    """Send `send_id` while the receiver waits for `receive_id`; returns the receive's error
    (or nothing)."""
    sender, receiver, to_receiver, from_sender = linked
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(None, from_sender, receive_id, copies(pairs), timeout=timeout)
        except TransferFailed as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    sender.send(None, to_receiver, send_id, copies(pairs), timeout=10)
    thread.join(10)
    return errors


def test_an_empty_transfer_writes_and_waits_for_nothing(linked):
    sender, receiver, to_receiver, from_sender = linked
    sender.send(None, to_receiver, "empty", [], timeout=0.1)
    receiver.receive(None, from_sender, "empty", [], timeout=0.1)


def test_completions_match_request_ids_exactly(linked):
    """ "xr-1#0/2" contains "r-1#0/2": another request's completion never ends this one."""
    pairs = [(0, 0), (1, 1)]
    [error] = send_while_receiving(linked, "xr-1", "r-1", pairs, timeout=1)
    assert "no NIXL completion" in str(error)
    _, receiver, _, from_sender = linked
    receiver.receive(None, from_sender, "xr-1", copies(pairs), timeout=1)  # still there


def test_parts_of_a_receive_given_up_are_dropped_when_they_arrive_late(linked):
    """The receive timed out before the sender wrote: its parts, arriving afterwards, do not
    wait in the inbox for a receive that will never come."""
    _, receiver, _, from_sender = linked
    pairs = [(0, 0), (1, 1)]
    with pytest.raises(TransferFailed, match="no NIXL completion"):
        receiver.receive(None, from_sender, "late#1", copies(pairs), timeout=0.05)
    send_while_receiving(linked, "late#1", "late#1x", pairs, timeout=0.5)  # the late parts
    assert send_while_receiving(linked, "next", "next", pairs, timeout=10) == []
    assert receiver._inbox[from_sender] == set()


def test_errors_nixl_raises_become_transfer_failures(linked, monkeypatch):
    sender, _, to_receiver, _ = linked

    def broken(*args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(sender.agent, "initialize_xfer", broken)
    with pytest.raises(TransferFailed, match="NIXL write failed: NIXL_ERR_BACKEND"):
        sender.send(None, to_receiver, "r-2", copies([(0, 0), (1, 1), (2, 2)]), timeout=1)


def test_a_nixl_peer_stays_known_until_its_last_link_closes():
    sender, receiver = make_backend(1, seed=5), make_backend(1, None)
    try:
        info = receiver.local_info()
        first, second = sender.add_peer(info), sender.add_peer(info)
        assert first == second
        from_sender = receiver.add_peer(sender.local_info())
        sender.remove_peer(first)  # one link closed; the other still writes
        pairs = [(0, 3), (4, 1)]
        landed: list[BaseException] = []
        thread = threading.Thread(
            target=lambda: _receive(receiver, from_sender, pairs, landed), daemon=True
        )
        thread.start()
        sender.send(None, second, "req-1", copies(pairs), timeout=10)
        thread.join(10)
        assert landed == [] and not thread.is_alive()
        for src, dst in pairs:
            assert bool(
                (receiver.pools.tensors["kv"][dst] == sender.pools.tensors["kv"][src]).all()
            )
        sender.remove_peer(second)
        assert sender.peers == {}
    finally:
        sender.close()
        receiver.close()


def _receive(
    backend: NixlBackend, peer: str, pairs: list[tuple[int, int]], errors: list[BaseException]
) -> None:
    try:
        backend.receive(None, peer, "req-1", copies(pairs), timeout=10)
    except BaseException as exc:  # reported by the caller's assertion
        errors.append(exc)
