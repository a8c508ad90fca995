"""Transfer failures between a real prefill engine and a real decode engine, in one process, wired
through TransferSender / TransferReceiver on loopback.

Every scenario ends in one of two correct ways (docs/failure-handling.md): the decode engine
recomputes the request and its tokens equal a colocated engine's, or (policy `fail`) the request
ends with finish_reason "error" and a message. Afterwards both engines' caches pass
check_integrity() and, once the lease has passed, every block and slot is free again (nothing
leaks).

scenario where it breaks expected timeout receiver / sender stops waiting recompute / error peer
death link cut mid-transfer, peer gone recompute / error error every Nth operation either
backend (TCP), NIXL write the Nth fail, rest acked duplicate request id decode already runs that
id rejected, holds nothing stale / out-of-range dst sender writes outside the plan refused,
nothing else written stale source lease expired before the send failed, recompute invalid
request hashes, tokens, sampling state rejected, holds nothing layout mismatch handshake /
compatibility hash failed / rejected abort while receiving decode client goes away abort, both
sides free
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch

from hybridserve.transceiver.auth import new_secret
from hybridserve.transceiver.base import Pools, RegionCopy, TransferBackend
from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.endpoint import SendOutcome, TransferReceiver, TransferSender
from hybridserve.transceiver.faults import FaultInjectingBackend, WrappedBackend
from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import Challenge, Hello, TransferRequest, to_dict
from hybridserve.transceiver.registry import create_backend
from hybridserve.transceiver.tcp_backend import TcpBackend
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from tests.helpers import TRANSFER_SECRET, assert_pools_at_baseline, make_hf_model
from tests.transceiver.link import (
    ENGINE_ARGS,
    GREEDY,
    LEASE,
    SPECS,
    TIMEOUT,
    Link,
    assert_recomputed_or_failed,
    wait_until,
)

SEEDED_CHOICES = SamplingParams(
    n=3, seed=40, temperature=0.9, max_tokens=4, ignore_eos=True, logprobs=2
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("bamba")
    make_hf_model("bamba").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str, list[int]]:
    """The oracle: each request's tokens from one colocated engine."""
    engine = Engine(EngineConfig(model=checkpoint, **ENGINE_ARGS))
    for spec in SPECS:
        engine.add_request(spec.prompt, SamplingParams(**spec.params), request_id=spec.request_id)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    assert all(len(t) == 4 for t in tokens.values()) and len(tokens) == len(SPECS)
    return tokens


def _is_clean(engine: Engine) -> bool:
    cache = engine.cache
    return (
        not engine.has_unfinished_requests()
        and not engine.has_pending_transfers()
        and cache.num_free_blocks == engine.num_kv_blocks
        and cache.num_free_slots == cache.mamba.num_live_slots
    )


@pytest.fixture(scope="module")
def engine_pool(checkpoint) -> Callable[..., Engine]:
    """Engines are shared by the tests of this module (loading one costs more than most
    scenarios): every scenario leaves them at baseline, which it asserts; one that a failed
    test left dirty is replaced, so that one failure does not cascade."""
    engines: dict[tuple[str, str], Engine] = {}

    def get(role: str, variant: str = "", **args: Any) -> Engine:
        key = (role, variant)
        if key not in engines or not _is_clean(engines[key]):
            config = ENGINE_ARGS | {"model": checkpoint, "role": role} | args
            engines[key] = Engine(EngineConfig(**config))
        return engines[key]

    return get


@pytest.fixture
def make_link(engine_pool) -> Iterator[Callable[..., Link]]:
    links: list[Link] = []

    def build(
        *,
        policy: str = "recompute",
        backend: str = "tcp",
        wrap_sender: Callable[[TransferBackend], TransferBackend] = lambda b: b,
        wrap_receiver: Callable[[TransferBackend], TransferBackend] = lambda b: b,
        sender_timeout: float = TIMEOUT,
        receiver_timeout: float = TIMEOUT,
        sender_deadline: float = 60.0,
        receiver_deadline: float = 60.0,
        receiver_secret: str = TRANSFER_SECRET,
        decode_args: dict[str, Any] | None = None,
    ) -> Link:
        prefill = engine_pool("prefill", transfer_lease_seconds=LEASE)
        decode = engine_pool(
            "decode", f"{policy}{decode_args}", transfer_failure_policy=policy, **decode_args or {}
        )
        # NOTE: a failed NIXL receive keeps its pages 5 s (a late write may still land);
        # shortened so that the baseline check does not wait that long.
        decode.receives.quarantine_seconds = LEASE
        prefill_lock, decode_lock = threading.Lock(), threading.Lock()
        receiver = TransferReceiver(
            decode,
            decode.layout,
            wrap_receiver(
                create_backend(backend, Pools.of(decode.caches), decode.config.transfer_streams)
            ),
            secret=receiver_secret,
            lock=decode_lock,
            host="127.0.0.1",
            timeout=receiver_timeout,
            deadline=receiver_deadline,
        )
        sender = TransferSender(
            prefill,
            prefill.layout,
            wrap_sender(
                create_backend(backend, Pools.of(prefill.caches), prefill.config.transfer_streams)
            ),
            receiver.address,
            secret=TRANSFER_SECRET,
            lock=prefill_lock,
            timeout=sender_timeout,
            deadline=sender_deadline,
        )
        link = Link(prefill, decode, sender, receiver, prefill_lock, decode_lock)
        links.append(link)
        return link

    yield build
    for link in links:
        link.sender.close_link()
        link.receiver.close()
        link.sender.backend.close()
        link.receiver.backend.close()


# ---- a clean transfer (the control) ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_a_clean_transfer_equals_colocated(make_link, expected, backend):
    link = make_link(backend=backend)
    outcomes = link.transfer(SPECS)
    assert [o.status for o in outcomes] == ["acked"] * len(SPECS)
    # Every prompt block crosses (the decode side holds nothing yet), then its Mamba state.
    assert [o.blocks_sent for o in outcomes] == [3, 4, 2, 3]
    assert [o.blocks_held for o in outcomes] == [0, 0, 0, 0]
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == expected
    link.assert_at_baseline()


def test_a_hand_off_carries_the_choices_and_logprobs_and_the_decode_engine_forks(
    make_link, checkpoint
):
    """n = 3 with logprobs: the prefill engine draws the three first tokens from the prompt's
    last row and hands off one request; the decode engine forks the other two choices there.
    Oracle: the same request on one colocated engine."""
    params = SEEDED_CHOICES
    colocated = Engine(EngineConfig(model=checkpoint, **ENGINE_ARGS))
    colocated.add_request(SPECS[1].prompt, params, request_id="r1")
    expected = {}
    while colocated.has_unfinished_requests():
        expected |= {o.request_id: o for o in colocated.step() if o.finished}
    link = make_link()
    spec = dataclasses.replace(SPECS[1], params=params.model_dump())
    (outcome,) = link.transfer([spec])
    assert outcome.status == "acked"
    finished = link.decode_all()
    assert sorted(finished) == sorted(expected) == ["r1", "r1#1", "r1#2"]
    for request_id, output in finished.items():
        assert output.token_ids == expected[request_id].token_ids, request_id
        got, want = output.logprobs, expected[request_id].logprobs
        assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want]
        assert [v for lp in got for _, v in lp.top] == pytest.approx(
            [v for lp in want for _, v in lp.top], abs=1e-5
        )
    assert (link.prefill.scheduler.num_forks, link.decode.scheduler.num_forks) == (0, 2)
    link.assert_at_baseline()


# ---- timeouts -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_receiver_timeout_recomputes_or_fails(make_link, expected, policy):
    """The sender stalls longer than the receiver waits for data."""
    link = make_link(
        policy=policy,
        wrap_sender=lambda b: FaultInjectingBackend(b, delay_seconds=0.6),
        receiver_timeout=0.2,
    )
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    finished = link.decode_all()
    assert_recomputed_or_failed(
        finished,
        {s.request_id: expected[s.request_id] for s in SPECS[:2]},
        policy,
        failed=dict.fromkeys(["r0", "r1"], "transfer peer sent nothing for 0.2 s"),
    )
    link.assert_at_baseline()


def test_a_sender_timeout_frees_the_prefill_side_at_once(make_link, expected):
    """The receiver stalls longer than the sender waits for its ack: the sender gives up and
    (TCP: nothing can read its pages any more) frees them; the decode side still ends the
    request correctly, whether its data completed before the abort or not."""
    link = make_link(
        wrap_receiver=lambda b: FaultInjectingBackend(b, delay_seconds=0.5), sender_timeout=0.2
    )
    (handoff,) = link.hand_off(SPECS[:1])
    outcome = link.sender.send("r0", handoff.message)
    assert outcome.status == "failed"
    assert "sent nothing for 0.2 s" in outcome.detail
    with link.prefill_lock:
        assert "r0" not in link.prefill.handoffs.pending  # released before any lease expiry
        assert link.prefill.cache.num_free_blocks == link.prefill.num_kv_blocks
    finished = link.decode_all()
    assert finished["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()


# ---- peer death -----------------------------------------------------------------------------


class DiesMidway(WrappedBackend):
    """Moves the first `regions` regions, then its process "dies": the link is cut."""

    def __init__(self, inner: TransferBackend, regions: int = 1) -> None:
        super().__init__(inner)
        self.regions = regions

    def send(self, channel, peer, request_id, copies, timeout) -> None:
        self.inner.send(channel, peer, request_id, copies[: self.regions], timeout)
        channel.close()
        raise TransferFailed("prefill process died")

    def receive(self, channel, peer, request_id, copies, timeout) -> None:
        self.inner.receive(channel, peer, request_id, copies[: self.regions], timeout)
        channel.close()
        raise TransferFailed("decode process died")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("dying", ["prefill", "decode"])
def test_peer_death_mid_transfer(make_link, expected, policy, dying):
    wrap = {f"wrap_{'sender' if dying == 'prefill' else 'receiver'}": DiesMidway}
    link = make_link(policy=policy, **wrap)
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    if dying == "prefill":
        assert all("prefill process died" in o.detail for o in outcomes)
        reason = "transfer peer closed the connection"
    else:
        reason = "decode process died"
    finished = link.decode_all()
    assert_recomputed_or_failed(
        finished,
        {s.request_id: expected[s.request_id] for s in SPECS[:2]},
        policy,
        failed=dict.fromkeys(["r0", "r1"], reason),
    )
    link.assert_at_baseline()


def test_a_closed_receiver_fails_every_later_send_cleanly(make_link, expected):
    """The decode engine goes away between requests: the open link notices, the sender
    cannot reconnect, and every handoff is released at once."""
    link = make_link()
    handoffs = link.hand_off(SPECS[:3])
    assert link.send(handoffs[0]).status == "acked"
    finished = link.decode_all()
    link.receiver.close()

    def links_closed() -> bool:  # each link thread notices the stop within its 0.5 s poll
        return not any(t.name == "transfer-receiver-link" for t in threading.enumerate())

    wait_until(links_closed, "the receiver's links to close")
    second, third = link.send(handoffs[1]), link.send(handoffs[2])
    assert (second.status, third.status) == ("failed", "failed")
    assert "cannot reach transfer peer" in third.detail
    assert finished["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()


# ---- an error every Nth operation -----------------------------------------------------------


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_an_error_every_second_operation(make_link, expected, policy, side):
    wrap = {f"wrap_{side}": lambda b: FaultInjectingBackend(b, fail_every=2)}
    link = make_link(policy=policy, **wrap)
    outcomes = link.transfer(SPECS)
    assert [o.status for o in outcomes] == ["acked", "failed", "acked", "failed"]
    if side == "sender":
        assert "injected fault (operation 2, every 2)" in outcomes[1].detail
        assert "injected fault (operation 4, every 2)" in outcomes[3].detail
    finished = link.decode_all()
    # The receiver names the fault: its own, or the sender's (carried by the TransferAbort).
    prefix = "sender aborted: " if side == "sender" else ""
    failed = {
        rid: f"{prefix}request {rid}: injected fault (operation {n}, every 2)"
        for rid, n in (("r1", 2), ("r3", 4))
    }
    assert_recomputed_or_failed(finished, expected, policy, failed)
    link.assert_at_baseline()


def test_a_failed_nixl_write_holds_both_sides_until_no_write_can_land(make_link, expected):
    """NIXL writes come from the peer's NIC: a failed one may still land, so the prefill side
    keeps its pages until the lease and the decode side quarantines the destination; both
    are free afterwards, and the request is recomputed."""
    link = make_link(
        backend="nixl",
        wrap_sender=lambda b: FaultInjectingBackend(b, fail_every=2),
        receiver_timeout=0.5,
    )
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["acked", "failed"]
    assert "injected fault (operation 2, every 2)" in outcomes[1].detail
    with link.prefill_lock:
        assert "r0" not in link.prefill.handoffs.pending  # acked: freed at once
        assert "r1" in link.prefill.handoffs.pending  # held until the lease
    with link.decode_lock:
        assert link.decode.receives.quarantined  # r1's destination
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == {
        "r0": expected["r0"],
        "r1": expected["r1"],
    }
    link.assert_at_baseline()


# ---- duplicate, stale and out-of-range ------------------------------------------------------


def test_a_duplicate_request_id_is_rejected_and_holds_nothing(make_link, expected):
    link = make_link()
    (first,) = link.hand_off(SPECS[:1])
    assert link.send(first).status == "acked"
    # The same id again while the decode engine still runs the first one (another prompt).
    (again,) = link.hand_off([dataclasses.replace(SPECS[1], request_id="r0")])
    with link.decode_lock:
        free = (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots)
    outcome = link.send(again)
    assert outcome.status == "rejected"
    assert outcome.detail == "duplicate_request: request id 'r0' is already in use here"
    with link.decode_lock:
        assert (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots) == free
    with link.prefill_lock:
        assert "r0" not in link.prefill.handoffs.pending  # released at once
    finished = link.decode_all()
    assert list(finished) == ["r0"]
    assert finished["r0"].token_ids == expected["r0"]  # the first one, untouched
    link.assert_at_baseline()


class RewritesDestinations(WrappedBackend):
    """A misbehaving sender that writes where it likes instead of where the plan says."""

    def __init__(self, inner: TransferBackend, rewrite: Callable[[RegionCopy], int]) -> None:
        super().__init__(inner)
        self.rewrite = rewrite
        self.sent: list[list[RegionCopy]] = []

    def send(self, channel, peer, request_id, copies, timeout) -> None:
        self.sent.append(copies)
        if len(self.sent) > 1:  # the first transfer is honest
            copies = [dataclasses.replace(c, dst=self.rewrite(c)) for c in copies]
        self.inner.send(channel, peer, request_id, copies, timeout)

    def receive(self, channel, peer, request_id, copies, timeout) -> None:
        raise AssertionError("sender only")


def _first_plan_dst(backend: RewritesDestinations, copy: RegionCopy) -> int:
    """Replay the destinations of the first (already acked) transfer: a consumed reference."""
    earlier = [c.dst for c in backend.sent[0] if c.kind == copy.kind]
    return earlier[0]


@pytest.mark.parametrize(
    ("case", "rewrite"),
    [
        ("block out of range", lambda b, c: 10_000 if c.kind == "kv" else c.dst),
        ("block id -1", lambda b, c: -1 if c.kind == "kv" else c.dst),
        ("slot out of range", lambda b, c: 999 if c.kind == "ssm" else c.dst),
        ("stale block of another request", lambda b, c: _first_plan_dst(b, c)),
        (
            "stale slot of another request",
            lambda b, c: _first_plan_dst(b, c) if c.kind == "conv" else c.dst,
        ),
    ],
)
def test_stale_or_out_of_range_destinations_are_refused_and_nothing_else_is_written(
    make_link, expected, case, rewrite, caplog
):
    backends: list[RewritesDestinations] = []

    def wrap(inner: TransferBackend) -> TransferBackend:
        backends.append(RewritesDestinations(inner, lambda c: rewrite(backends[0], c)))
        return backends[0]

    link = make_link(wrap_sender=wrap)
    first, second = link.hand_off(SPECS[:2])
    assert link.send(first).status == "acked"
    with link.decode_lock:
        caches = link.decode.caches
        before = (caches.kv.clone(), caches.conv.clone(), caches.ssm.clone())
    outcome = link.send(second)
    assert outcome.status == "failed"
    # The receiver named the reason when it refused (the sender only saw the link drop).
    assert "request r1: transfer failed (request r1: expected " in caplog.text
    assert "(stale or out-of-range destination)); policy recompute" in caplog.text
    # The regions the receive plan gave r1 (before the sender rewrote them): the receiver may
    # have filled those (they are r1's, now quarantined); nothing else may have changed.
    planned = backends[0].sent[1]
    with link.decode_lock:
        for kind, old in zip(("kv", "conv", "ssm"), before, strict=True):
            new = getattr(caches, kind)
            untouched = torch.ones(new.shape[0], dtype=torch.bool)
            untouched[[c.dst for c in planned if c.kind == kind]] = False
            assert torch.equal(new[untouched], old[untouched]), (case, kind)
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == {
        "r0": expected["r0"],
        "r1": expected["r1"],  # recomputed
    }
    link.assert_at_baseline()


def test_a_handoff_released_by_its_lease_is_never_read(make_link, expected):
    """Stale source: the prefill side freed (and may reuse) the pages when the lease passed;
    a late send must not read them, and the decode side recomputes."""
    link = make_link()
    (handoff,) = link.hand_off(SPECS[:1])
    time.sleep(LEASE + 0.05)
    with link.prefill_lock:
        assert link.prefill.step() == []  # idle, but the lease is enforced on every step
        assert "r0" not in link.prefill.handoffs.pending
    outcome = link.send(handoff)
    assert outcome.status == "failed"
    assert "the handoff was released (lease expired or aborted)" in outcome.detail
    finished = link.decode_all()
    assert finished["r0"].token_ids == expected["r0"]
    link.assert_at_baseline()


def test_expired_leases_free_a_full_prefill_engine(checkpoint):
    """Handoffs hold every live slot of the prefill engine and no ack comes: a new request
    waits (no crash) while the leases run, and runs once they expire (the TRT-LLM circular
    dependency: the sweep must not depend on scheduling)."""
    args = ENGINE_ARGS | {"max_num_seqs": 2}  # two live slots
    engine = Engine(
        EngineConfig(model=checkpoint, role="prefill", transfer_lease_seconds=0.5, **args)
    )
    for spec in SPECS[:2]:
        engine.add_request(spec.prompt, SamplingParams(**GREEDY), request_id=spec.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert [h.request.request_id for h in engine.take_handoffs()] == ["r0", "r1"]
    engine.add_request(SPECS[2].prompt, SamplingParams(**GREEDY), request_id="r2")
    assert engine.step() == []  # nothing fits yet: wait, do not raise
    assert "r0" in engine.handoffs.pending
    time.sleep(0.55)
    outputs = engine.step()  # the leases expire first, then r2 is admitted
    assert [o.request_id for o in outputs] == ["r2"]
    assert [h.request.request_id for h in engine.take_handoffs()] == ["r2"]
    assert "r0" not in engine.handoffs.pending and "r1" not in engine.handoffs.pending
    engine.check_integrity()
    time.sleep(0.55)  # r2's lease
    assert engine.step() == []
    assert not engine.has_pending_transfers()
    assert_pools_at_baseline(engine)


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
    ]
    with link.decode_lock:
        free = (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots)
    for code, change in cases:
        outcome = link.send(bad, dataclasses.replace(message, **change))
        assert outcome.status == "rejected", (code, change)
        assert outcome.detail.startswith(f"{code}: request r0"), outcome.detail
        with link.prefill_lock:  # a rejection frees the prefill side at once
            assert "r0" not in link.prefill.handoffs.pending
        with link.decode_lock:
            assert (link.decode.cache.num_free_blocks, link.decode.cache.num_free_slots) == free
            assert not link.decode.has_unfinished_requests()
    assert link.send(good).status == "acked"
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == {"r1": expected["r1"]}
    link.assert_at_baseline()


# ---- layout mismatch ------------------------------------------------------------------------


def test_a_layout_mismatch_fails_the_handshake_and_holds_nothing(make_link):
    """The SSM state dtypes differ (SGLang #36371 accepted this and corrupted the state)."""
    link = make_link(decode_args={"mamba_ssm_dtype": "bfloat16"})
    assert link.prefill.layout.compatibility_hash() != link.decode.layout.compatibility_hash()
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    for outcome in outcomes:
        assert "peer layout is incompatible" in outcome.detail
        assert "ssm_dtype: local 'torch.bfloat16' vs peer 'torch.float32'" in outcome.detail
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
            return "r0" in link.decode.receives.receiving

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
        assert "r0" in link.prefill.handoffs.pending
        assert link.prefill.cache.num_free_blocks == free_while_held
        with pytest.raises(ValueError, match="'r0' is already in use"):
            link.prefill.add_request(SPECS[0].prompt, request_id="r0")
    gate.proceed.set()
    sending.join(5)
    assert [o.status for o in outcomes] == ["acked"]  # the data itself was whole
    with link.prefill_lock:
        assert "r0" not in link.prefill.handoffs.pending
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
            return "r0" in link.decode.receives.receiving

    wait_until(receiving, "the transfer to start")
    with link.decode_lock:
        link.decode.abort("r0")
        assert link.decode.receives.quarantined
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
        assert "r3" not in link.prefill.handoffs.pending  # freed at once, not at the lease
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
