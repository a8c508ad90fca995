"""Transfers refused or cut short, between a real prefill engine and a real decode engine, in one
process, wired through TransferSender / TransferReceiver on loopback.

Scenarios, as `scenario (where it breaks): expected`:

- invalid request (block hashes, tokens, sampling state): rejected, holds nothing
- layout mismatch (the handshake / the compatibility hash): failed / rejected
- abort while receiving (the decode client goes away): abort, both sides free
- lease expiry or abort while a send reads the pages: they stay pinned until the send ends
- a trickling transfer (each region inside the read timeout): ended by its total deadline,
  recompute
- a partial transfer (the KV or the Mamba state missing): never decoded; recompute / error
- a late write after a decode abort: lands in quarantined pages, never the next request's
- a full decode engine (no room right now): rejected with no_capacity, holds nothing
- who may connect (another deployment's secret, hostile links): refused and counted; the
  receiver serves afterwards

Every scenario ends with both engines at baseline: their caches pass check_integrity() and,
once the lease (and any quarantine) has passed, every block and slot is free again (nothing
leaks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import socket
import threading
import time
from typing import Any

import msgpack
import pytest

from hybridserve.transceiver.auth import new_secret
from hybridserve.transceiver.base import TransferBackend
from hybridserve.transceiver.channel import Channel
from hybridserve.transceiver.endpoint import SendOutcome
from hybridserve.transceiver.faults import FaultInjectingBackend, WrappedBackend
from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import Challenge, Hello, TransferRequest, to_dict
from hybridserve.transceiver.tcp_backend import TcpBackend
from hybridserve.workers import SamplingParams
from tests.transceiver.link import (
    LEASE,
    SPECS,
    Link,
    assert_recomputed_or_failed,
    wait_until,
)

# ---- validation at the decode side ----------------------------------------------------------


def _sampling(message: TransferRequest, **change: Any) -> dict[str, Any]:
    return {"sampling": dataclasses.replace(message.sampling, **change)}


def test_invalid_transfer_requests_are_rejected_and_hold_nothing(make_link, expected):
    """Each is refused before anything is reserved, the prefill side frees at once, and the
    decode engine keeps serving (a malformed request must never take it down)."""
    link = make_link()
    bad, good = link.hand_off(SPECS[:2])
    message = bad.message
    cases = [
        # Block hashes of another prompt: a stale or corrupted transfer.
        ("bad_block_hashes", {"block_hashes": good.message.block_hashes}),
        ("invalid_request", {"prompt_token_ids": [*message.prompt_token_ids[:-1], 128]}),
        ("invalid_request", {"first_token": -1}),
        ("bad_state_pos", {"state_pos": message.state_pos - 1}),
        ("too_long", {"prompt_token_ids": [1] * 96, "state_pos": 96}),
        ("layout_mismatch", {"compatibility_hash": "0" * 32}),
        ("invalid_request", _sampling(message, params={"temperature": -1.0})),
        ("invalid_request", _sampling(message, params={"max_tokens": "many"})),
        ("invalid_request", _sampling(message, params=[1, 2])),
        # The sampler would raise on these mid-step, for the whole batch.
        ("invalid_request", _sampling(message, sample_seed="not a seed")),
        ("invalid_request", _sampling(message, stop_token_ids=["eos"])),
        ("invalid_request", _sampling(message, stop_token_ids=7)),
        # MTP guesses are tokens too: one outside the vocabulary would index past the rows.
        ("invalid_request", _sampling(message, draft_token_ids=[3, 128])),
        ("invalid_request", _sampling(message, draft_token_ids=5)),
    ]
    with link.decode_lock:
        free = (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots)
    for code, change in cases:
        outcome = link.send(bad, dataclasses.replace(message, **change))
        assert outcome.status == "rejected", (code, change)
        assert outcome.detail.startswith(f"{code}: request r0"), outcome.detail
        with link.prefill_lock:  # a rejection frees the prefill side at once
            assert "r0" not in link.prefill.prefill_port.pending
        with link.decode_lock:
            assert (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots) == free
            assert not link.decode.has_unfinished_requests()
    assert link.send(good).status == "acked"
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == {"r1": expected["r1"]}
    link.assert_at_baseline()


# ---- layout mismatch ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decode_args", "decode_side", "prefill_side"),
    [
        ({"recurrent_state_dtype": "bfloat16"},
         "['ssm', 'torch.bfloat16'", "['ssm', 'torch.float32'"),
        ({"conv_state_dtype": "bfloat16"}, "['conv', 'torch.bfloat16'", "['conv', 'torch.float32'"),
        ({"kv_cache_dtype": "fp8"}, "kv_dtype: local 'torch.float8_e4m3fn'", "'torch.float32'"),
    ],
)  # fmt: skip
def test_a_layout_mismatch_fails_the_handshake_and_holds_nothing(
    make_link, decode_args, decode_side, prefill_side
):
    """A state tensor's or the KV cache's dtypes differ (SGLang #36371 accepted this for the
    SSM state and corrupted it); the detail names the field."""
    link = make_link(decode_args=decode_args)
    assert link.prefill.layout.compatibility_hash() != link.decode.layout.compatibility_hash()
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    for outcome in outcomes:
        assert "peer layout is incompatible" in outcome.detail
        local, peer = outcome.detail.split(" vs peer ", 1)
        assert decode_side in local and prefill_side in peer
    link.assert_at_baseline()


def test_a_backend_mismatch_fails_the_handshake(make_link):
    class OtherBackend(TcpBackend):
        name = "shm"

    link = make_link(wrap_sender=lambda b: OtherBackend(b.pools))
    (outcome,) = link.transfer(SPECS[:1])
    assert outcome.status == "failed"
    assert "peer uses transfer backend 'shm', this engine 'tcp'" in outcome.detail
    link.assert_at_baseline()


# ---- aborts ---------------------------------------------------------------------------------


def test_a_decode_abort_while_receiving_ends_both_sides_cleanly(make_link):
    """The client goes away while the data is on its way: the decode side returns an abort,
    the transfer then ends without an ack, and both sides free everything."""
    link = make_link(wrap_receiver=lambda b: FaultInjectingBackend(b, delay_seconds=0.3))
    (handoff,) = link.hand_off(SPECS[:1])
    outcomes: list[SendOutcome] = []
    sending = threading.Thread(
        target=lambda: outcomes.append(link.sender.send("r0", handoff.message))
    )
    sending.start()

    def receiving() -> bool:
        with link.decode_lock:
            return "r0" in link.decode.decode_port.receiving

    wait_until(receiving, "the transfer to start")
    with link.decode_lock:
        aborted = link.decode.abort("r0")
    assert aborted is not None and aborted.finish_reason == "abort"
    sending.join(timeout=5)
    (outcome,) = outcomes
    assert outcome.status == "failed"
    assert "unknown_request" in outcome.detail
    assert link.decode_all() == {}
    link.assert_at_baseline()


class Gated(WrappedBackend):
    """Sends the first region, then holds the send open until the test lets it go on."""

    def __init__(self, inner: TransferBackend) -> None:
        super().__init__(inner)
        self.started, self.proceed = threading.Event(), threading.Event()

    def send(self, channel, peer, request_id, copies, timeout) -> None:
        self.inner.send(channel, peer, request_id, copies[:1], timeout)
        self.started.set()
        assert self.proceed.wait(5), "the test never let the send go on"
        self.inner.send(channel, peer, request_id, copies[1:], timeout)


def gated_link(make_link) -> tuple[Link, Gated]:
    backends: list[Gated] = []

    def wrap(inner: TransferBackend) -> Gated:
        backends.append(Gated(inner))
        return backends[0]

    return make_link(wrap_sender=wrap), backends[0]


def send_in_thread(link: Link, handoff) -> tuple[threading.Thread, list[SendOutcome]]:
    outcomes: list[SendOutcome] = []
    rid = handoff.request.request_id
    thread = threading.Thread(
        target=lambda: outcomes.append(link.sender.send(rid, handoff.message))
    )
    thread.start()
    return thread, outcomes


@pytest.mark.parametrize("release", ["lease", "abort"])
def test_pages_a_send_reads_stay_pinned_through_a_lease_expiry_or_an_abort(
    make_link, expected, release
):
    """Scenarios 12 and 18: the lease runs out, or the request is aborted, while its data is
    going out. Nothing is freed under the send (freed pages could be reallocated and
    overwritten mid-send), the id stays taken, and everything goes once the send ends."""
    link, gate = gated_link(make_link)
    (handoff,) = link.hand_off(SPECS[:1])
    with link.prefill_lock:
        free_while_held = link.prefill.cache.num_free_blocks
    assert free_while_held < link.prefill.num_kv_blocks
    sending, outcomes = send_in_thread(link, handoff)
    assert gate.started.wait(5)
    if release == "lease":
        time.sleep(LEASE + 0.05)
        with link.prefill_lock:
            assert link.prefill.step() == []  # sweeps the expired lease
    else:
        with link.prefill_lock:
            aborted = link.prefill.abort("r0")
        assert aborted is not None and aborted.finish_reason == "abort"
    with link.prefill_lock:
        assert "r0" in link.prefill.prefill_port.pending
        assert link.prefill.cache.num_free_blocks == free_while_held
        with pytest.raises(ValueError, match="'r0' is already in use"):
            link.prefill.add_request(SPECS[0].prompt, request_id="r0")
    gate.proceed.set()
    sending.join(5)
    assert [o.status for o in outcomes] == ["acked"]  # the data itself was whole
    with link.prefill_lock:
        assert "r0" not in link.prefill.prefill_port.pending
        assert link.prefill.cache.num_free_blocks == link.prefill.num_kv_blocks
    assert link.decode_all()["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()


class Trickles(WrappedBackend):
    """Sends each region after a pause, every pause well inside the read timeout."""

    def send(self, channel, peer, request_id, copies, timeout) -> None:
        for copy in copies:
            time.sleep(0.15)
            self.inner.send(channel, peer, request_id, [copy], timeout)


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_a_trickling_transfer_ends_at_its_total_deadline(make_link, expected, side, caplog):
    """Five regions at 0.15 s each never trip the 2 s inactivity timeout; the 0.4 s deadline
    on either side ends the transfer, and the decode side recomputes."""
    link = make_link(wrap_sender=Trickles, **{f"{side}_deadline": 0.4})
    (outcome,) = link.transfer(SPECS[:1])
    assert outcome.status == "failed"
    assert "the transfer did not finish within its 0.4 s deadline" in caplog.text
    assert link.decode_all()["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()


class Drops(WrappedBackend):
    """Sends every region but those of `kinds`, then completes as if all were sent."""

    def __init__(self, inner: TransferBackend, kinds: tuple[str, ...]) -> None:
        super().__init__(inner)
        self.kinds = kinds

    def send(self, channel, peer, request_id, copies, timeout) -> None:
        kept = [c for c in copies if c.kind not in self.kinds]
        self.inner.send(channel, peer, request_id, kept, timeout)


@pytest.mark.parametrize(
    ("missing", "shown"),
    [(("conv", "ssm"), "bytes of conv"), (("kv",), "bytes of kv")],
    ids=["mamba-state-missing", "kv-missing"],
)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_partial_transfer_is_never_decoded(make_link, expected, missing, shown, policy):
    """Scenario 7: the KV blocks arrive and the Mamba state does not, or the reverse. The
    receiver expects every region of its plan, so the request never decodes from incomplete
    state: it is recomputed (equal to colocated) or ends with an error."""
    link = make_link(policy=policy, wrap_sender=lambda b: Drops(b, missing))
    (outcome,) = link.transfer(SPECS[:1])
    assert outcome.status == "failed"
    finished = link.decode_all()
    assert_recomputed_or_failed(finished, {"r0": expected["r0"]}, policy, {"r0": shown})
    link.assert_at_baseline()


def test_a_late_write_after_a_decode_abort_never_reaches_the_next_request(make_link, expected):
    """Scenario 13: the decode side aborts while the sender is still writing. The aborted
    destination stays quarantined (the late writes land there, not in pages someone else
    got), so a request admitted at once equals its isolated reference."""
    link, gate = gated_link(make_link)
    (handoff,) = link.hand_off(SPECS[:1])
    sending, outcomes = send_in_thread(link, handoff)
    assert gate.started.wait(5)

    def receiving() -> bool:
        with link.decode_lock:
            return "r0" in link.decode.decode_port.receiving

    wait_until(receiving, "the transfer to start")
    with link.decode_lock:
        link.decode.abort("r0")
        assert link.decode.decode_port.quarantined
        link.decode.add_request(SPECS[2].prompt, SamplingParams(**SPECS[2].params), request_id="r2")
        link.decode.step()  # r2 takes its pages before the late writes come
    gate.proceed.set()  # the rest of r0's data lands now
    sending.join(5)
    assert [o.status for o in outcomes] == ["failed"]
    assert link.decode_all()["r2"].token_ids == expected["r2"]
    link.assert_at_baseline()


def test_a_full_decode_engine_rejects_with_no_capacity_and_holds_nothing(make_link, expected):
    """Scenario 17 on the decode side: no room for the transfer right now. The rejection
    holds nothing on either side; once the decode engine has room, the same request goes
    through."""
    # 6 blocks: r1 (4 blocks) takes most, r3's 3 do not fit beside it.
    link = make_link(decode_args={"num_kv_blocks": 6})
    first, second = link.hand_off([SPECS[1], SPECS[3]])
    assert link.send(first).status == "acked"
    outcome = link.send(second)
    assert outcome.status == "rejected" and "no_capacity" in outcome.detail
    with link.prefill_lock:
        assert "r3" not in link.prefill.prefill_port.pending  # freed at once, not at the lease
    with link.decode_lock:
        assert not link.decode.has_request("r3")
    assert link.decode_all()["r1"].token_ids == expected["r1"]
    (again,) = link.hand_off([SPECS[3]])
    assert link.send(again).status == "acked"
    assert link.decode_all()["r3"].token_ids == expected["r3"]
    link.assert_at_baseline()


# ---- who may connect ------------------------------------------------------------------------


def test_a_sender_with_another_deployment_s_secret_is_refused(make_link):
    link = make_link(receiver_secret=new_secret())
    (outcome,) = link.transfer(SPECS[:1])
    assert outcome.status == "failed"
    assert "could not prove that it belongs to the deployment" in outcome.detail
    # The receiver counts the refusal after telling the sender: it may land a moment later.
    wait_until(lambda: link.receiver.refused_links, "the receiver to count the refusal")
    assert link.receiver.refused_links == {"unauthenticated": 1}
    with link.decode_lock:
        assert not link.decode.has_request("r0")
    link.assert_at_baseline()


def _framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


class _Exploit:
    """Creates a file if anything ever unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _fuzz_cases(layout: PeerLayout, marker: str) -> dict[str, bytes]:
    def hello(**change: Any) -> bytes:
        forged = Hello(layout, "tcp", nonce=b"\x01" * 16, proof=b"x" * 32)
        return _framed(msgpack.packb(to_dict(forged) | change))

    return {
        "pickle": _framed(pickle.dumps(_Exploit(marker))),
        "oversize header": b"\xff\xff\xff\xff",
        "oversize hello": (2 << 20).to_bytes(4, "big") + b"\x00" * 1024,
        "wrong version": hello(v=4),
        "wrong field types": hello(layout=5, backend_info=[1]),
        "unauthenticated hello": hello(),
        "garbage": _framed(bytes(range(256)) * 4),
    }


def test_the_receiver_survives_hostile_links_and_serves_afterwards(make_link, expected, tmp_path):
    """A live receiver, its real socket: each hostile opening gets the link closed (nothing
    unpickled, nothing allocated beyond the handshake's cap, counted by reason), and a normal
    transfer succeeds afterwards."""
    link = make_link()
    marker = tmp_path / "unpickled"
    cases = _fuzz_cases(link.decode.layout, str(marker))
    for name, payload in cases.items():
        with socket.create_connection(link.receiver.address, timeout=5) as sock:
            challenge = Channel(sock, timeout=5).receive()
            assert isinstance(challenge, Challenge), name
            sock.sendall(payload)
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(4096):  # a TransferError may come first; then the close
                    pass
    assert not marker.exists()
    refused = link.receiver.refused_links
    assert sum(refused.values()) == len(cases), refused
    assert refused["unauthenticated"] >= 1 and refused["malformed"] >= 5, refused
    (outcome,) = link.transfer(SPECS[:1])
    assert outcome.ok
    assert link.decode_all()["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()
