"""PeerSenders (cluster/engine_host/transfer_links.py): sends to one decode peer share its senders,
never two at once on one sender, and a failed send closes the idle links. Stand-in senders here;
real engines moving real transfers over several links: tests/transceiver/test_peer_links.py."""

from __future__ import annotations

import threading
import time

from hybridserve.cluster.engine_host.transfer_links import PeerSenders
from hybridserve.transceiver.endpoint import SendOutcome


class StandIn:
    """A sender that records what it carried, how many sends ran at once on all stand-ins
    (`busy`), and whether its link was closed."""

    def __init__(self, name: str, busy: dict[str, int], lock: threading.Lock) -> None:
        self.name = name
        self.busy, self.lock = busy, lock
        self.carried: list[str] = []
        self.in_use = False
        self.closed = 0

    def send(self, request_id: str, message: object) -> SendOutcome:
        assert not self.in_use, f"{self.name} carries two sends at once"
        self.in_use = True
        with self.lock:
            self.busy["now"] += 1
            self.busy["most"] = max(self.busy["most"], self.busy["now"])
        time.sleep(0.02)
        with self.lock:
            self.busy["now"] -= 1
        self.in_use = False
        self.carried.append(request_id)
        status = "failed" if request_id.startswith("bad") else "acked"
        return SendOutcome(request_id, status, "")

    def close_link(self) -> None:
        self.closed += 1


def stand_ins(count: int) -> tuple[list[StandIn], dict[str, int]]:
    busy, lock = {"now": 0, "most": 0}, threading.Lock()
    return [StandIn(f"s{i}", busy, lock) for i in range(count)], busy


def test_more_sends_than_senders_queue_and_each_sender_carries_one_at_a_time():
    senders, busy = stand_ins(2)
    pool = PeerSenders(senders, "test-send")  # type: ignore[arg-type]
    try:
        sends = [pool.submit(f"r{i}", None) for i in range(7)]  # type: ignore[arg-type]
        assert [s.result(timeout=5).status for s in sends] == ["acked"] * 7
    finally:
        pool.close()
    assert busy["most"] == 2
    assert sorted(r for s in senders for r in s.carried) == [f"r{i}" for i in range(7)]


def test_one_send_at_a_time_keeps_to_the_sender_used_last():
    senders, _ = stand_ins(3)
    pool = PeerSenders(senders, "test-send")  # type: ignore[arg-type]
    try:
        for i in range(4):
            pool.submit(f"r{i}", None).result(timeout=5)  # type: ignore[arg-type]
    finally:
        pool.close()
    assert [len(s.carried) for s in senders] == [4, 0, 0]  # no link opened that was not needed


def test_a_failed_send_closes_the_idle_links():
    senders, _ = stand_ins(3)
    pool = PeerSenders(senders, "test-send")  # type: ignore[arg-type]
    try:
        assert pool.submit("bad-1", None).result(timeout=5).status == "failed"  # type: ignore[arg-type]
        assert [s.closed for s in senders] == [1, 1, 1]
        assert pool.submit("r1", None).result(timeout=5).status == "acked"  # type: ignore[arg-type]
        assert [s.closed for s in senders] == [1, 1, 1]  # a good send closes nothing
    finally:
        pool.close()
    assert [s.closed for s in senders] == [2, 2, 2]  # close() closes every link
