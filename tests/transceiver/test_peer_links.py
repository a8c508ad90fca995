"""What a transfer waits for: several links from a prefill engine to one decode engine
(cluster/engine_host/transfer_links.py, `PeerSenders`) move transfers at once, each landing as on a
link of its own, and a send reads its hand-off's pages while the prefill engine's step holds the
engine's lock. A NIXL peer with several links: test_nixl_backend.py.

The harness is test_faults.py's: a real prefill engine and a real decode engine on loopback.
"""

from __future__ import annotations

import threading

import pytest

from hybridserve.cluster.engine_host.transfer_links import PeerSenders
from hybridserve.transceiver.base import RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.endpoint import SendOutcome, TransferSender
from hybridserve.transceiver.faults import WrappedBackend
from tests.helpers import TRANSFER_SECRET
from tests.transceiver.link import SPECS, TIMEOUT, Link, wait_until


class Paired(WrappedBackend):
    """A send's data waits until another send has reached its data too: only transfers that
    move at once get through."""

    def __init__(self, inner: TransferBackend, parties: int) -> None:
        super().__init__(inner)
        self.together = threading.Barrier(parties, timeout=TIMEOUT)

    def send(
        self, channel: Channel, peer: str, request_id: str, copies: list[RegionCopy], timeout: float
    ) -> None:
        try:
            self.together.wait()
        except threading.BrokenBarrierError as exc:
            raise TransferFailed(f"request {request_id}: no other transfer moved with it") from exc
        super().send(channel, peer, request_id, copies, timeout)


def send_two(link: Link, senders: PeerSenders) -> list[SendOutcome]:
    """Hand off the first two requests and send both through `senders` at once."""
    try:
        handoffs = link.hand_off(SPECS[:2])
        sends = [senders.submit(h.request.request_id, h.message) for h in handoffs]
        return [send.result(timeout=3 * TIMEOUT) for send in sends]
    finally:
        senders.close()


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_two_links_carry_two_transfers_at_once(make_link, expected, backend):
    link = make_link(backend=backend, wrap_sender=lambda b: Paired(b, parties=2))
    second = TransferSender(
        link.prefill.prefill_port,
        link.prefill.layout,
        link.sender.backend,
        link.receiver.address,
        secret=TRANSFER_SECRET,
        lock=link.prefill_lock,
        timeout=TIMEOUT,
    )
    for sender in (link.sender, second):
        sender.connect()  # both links open: the two sends reach their data together
    outcomes = send_two(link, PeerSenders([link.sender, second], "test-send"))
    assert [o.status for o in outcomes] == ["acked", "acked"]
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == {
        spec.request_id: expected[spec.request_id] for spec in SPECS[:2]
    }
    link.assert_at_baseline()


def test_one_link_carries_one_transfer_at_a_time(make_link):
    """The control: the same two sends on one link cannot move at once (the first fails
    waiting for a second that never comes, the second finds the wait already given up), and
    both engines end at baseline."""
    link = make_link(wrap_sender=lambda b: Paired(b, parties=2))
    outcomes = send_two(link, PeerSenders([link.sender], "test-send"))
    assert [o.status for o in outcomes] == ["failed", "failed"]
    assert all("no other transfer moved with it" in o.detail for o in outcomes)
    link.decode_all()  # recomputed there (policy recompute)
    link.assert_at_baseline()


def test_a_send_moves_its_data_while_the_prefill_engine_steps(make_link, expected):
    """The prefill engine's lock held (a step in progress): the pages are pinned and sent,
    and the decode engine admits the request; only the release after the ack waits."""
    link = make_link()
    (handoff,) = link.hand_off(SPECS[:1])
    request_id = handoff.request.request_id
    with link.prefill_lock:
        outcomes: list[SendOutcome] = []
        sending = threading.Thread(
            target=lambda: outcomes.append(link.sender.send(request_id, handoff.message))
        )
        sending.start()
        wait_until(
            lambda: not link.decode.decode_port.receiving and link.decode.has_unfinished_requests(),
            "the decode engine to admit the request",
            timeout=TIMEOUT,
        )
        assert outcomes == []  # the sender waits to release the pages
    sending.join(TIMEOUT)
    assert [o.status for o in outcomes] == ["acked"]
    finished = link.decode_all()
    assert finished[request_id].token_ids == expected[request_id]
    link.assert_at_baseline()
