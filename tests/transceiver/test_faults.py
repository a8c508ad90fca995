"""Transfer failures between a real prefill engine and a real decode engine, in one process, wired
through TransferSender / TransferReceiver on loopback.

Every scenario ends in one of two correct ways (docs/failure-handling.md): the decode engine
recomputes the request and its tokens equal a colocated engine's, or (policy `fail`) the request
ends with finish_reason "error" and a message. Afterwards both engines' caches pass
check_integrity() and, once the lease has passed, every block and slot is free again (nothing
leaks).

Scenarios, as `scenario (where it breaks): expected`:

- a clean transfer, the control (also n = 3 with logprobs): equal to colocated
- timeout (the receiver / the sender stops waiting): recompute / error
- peer death (the link cut mid-transfer, the peer gone): recompute / error
- an error every Nth operation (the TCP backend on either side, a NIXL write): the Nth
  fail, the rest acked
- duplicate request id (the decode engine already runs that id): rejected, holds nothing
- stale / out-of-range destination (the sender writes outside the plan): refused, nothing else
  written
- stale source (the lease expired before the send): failed, recompute; expired leases free a
  full prefill engine

Refusals at the decode side, layout mismatches, aborts and who may connect are in
test_refusals_and_aborts.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
import torch

from hybridserve.transceiver.base import RegionCopy, TransferBackend
from hybridserve.transceiver.channel import TransferFailed
from hybridserve.transceiver.faults import FaultInjectingBackend, WrappedBackend
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from tests.helpers import assert_pools_at_baseline, make_hf_model
from tests.mtp import MTP_SPECULATION, add_mtp_layers
from tests.transceiver.link import (
    ENGINE_ARGS,
    GREEDY,
    LEASE,
    SPECS,
    assert_recomputed_or_failed,
    colocated_tokens,
    wait_until,
)

SEEDED_CHOICES = SamplingParams(
    n=3, seed=40, temperature=0.9, max_tokens=4, ignore_eos=True, logprobs=2
)


# ---- a clean transfer (the control) ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_a_clean_transfer_equals_colocated(make_link, expected, backend):
    link = make_link(backend=backend)
    landed: list[int] = []
    link.decode.decode_port.on_landed(lambda: landed.append(1))  # the host's wake-up
    outcomes = link.transfer(SPECS)
    assert [o.status for o in outcomes] == ["acked"] * len(SPECS)
    assert len(landed) == len(SPECS)
    # Every prompt block crosses (the decode side holds nothing yet), then its Mamba state.
    assert [o.blocks_sent for o in outcomes] == [3, 4, 2, 3]
    assert [o.blocks_held for o in outcomes] == [0, 0, 0, 0]
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == expected
    link.assert_at_baseline()


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_an_fp8_kv_cache_crosses_and_equals_colocated_fp8(make_link, checkpoint, backend):
    """Both engines with an FP8 KV cache: the blocks cross as the pool holds them (a byte a
    value) and decoding goes on as a colocated FP8 engine does."""
    fp8 = {"kv_cache_dtype": "fp8"}
    link = make_link(backend=backend, prefill_args=fp8, decode_args=fp8)
    outcomes = link.transfer(SPECS)
    assert [o.status for o in outcomes] == ["acked"] * len(SPECS)
    finished = link.decode_all()
    assert {rid: o.token_ids for rid, o in finished.items()} == colocated_tokens(checkpoint, **fp8)
    link.assert_at_baseline()


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_mtp_layers_kv_and_first_guesses_cross_and_equal_colocated(
    make_link, tmp_path_factory, backend
):
    """Both engines run a checkpoint's MTP layers: their KV over the prompt crosses with the
    blocks, the prefill engine's first guesses with the request, and the decode engine
    verifies them in its first step; the tokens are the colocated plain engine's."""
    folder = tmp_path_factory.mktemp("mtp")
    hf_model = make_hf_model("qwen3_5")
    hf_model.save_pretrained(folder)
    add_mtp_layers("qwen3_5", hf_model, folder)
    args = {"model": str(folder), "speculative_config": MTP_SPECULATION}
    link = make_link(backend=backend, prefill_args=args, decode_args=args)
    assert link.decode.layout.num_attention_layers == 3  # the model's two and the MTP one
    outcomes = link.transfer(SPECS)
    assert [o.status for o in outcomes] == ["acked"] * len(SPECS)
    received = [link.decode.requests[spec.request_id] for spec in SPECS]
    assert all(request.speculation.pending for request in received)
    finished = {rid: out.token_ids for rid, out in link.decode_all().items()}
    # Sampled rows draw as a colocated engine speculating the same way; greedy ones as one
    # that does not speculate at all.
    assert finished == colocated_tokens(str(folder), speculative_config=MTP_SPECULATION)
    plain = colocated_tokens(str(folder))
    greedy = [spec.request_id for spec in SPECS if spec.params["temperature"] == 0.0]
    assert [finished[rid] for rid in greedy] == [plain[rid] for rid in greedy]
    assert link.decode.scheduler.speculator.stats.num_draft_tokens > 0
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
    landed: list[int] = []
    link.decode.decode_port.on_landed(lambda: landed.append(1))  # recomputed or ended: work
    outcomes = link.transfer(SPECS[:2])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    wait_until(lambda: len(landed) == 2, "both failed receives to report")
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
        assert "r0" not in link.prefill.prefill_port.pending  # released before any lease expiry
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
        assert "r0" not in link.prefill.prefill_port.pending  # acked: freed at once
        assert "r1" in link.prefill.prefill_port.pending  # held until the lease
    with link.decode_lock:
        assert link.decode.decode_port.quarantined  # r1's destination
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
        assert "r0" not in link.prefill.prefill_port.pending  # released at once
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
        before = {kind: pool.clone() for kind, pool in caches.pools().items()}
    outcome = link.send(second)
    assert outcome.status == "failed"
    # The receiver named the reason when it refused (the sender only saw the link drop).
    assert "request r1: transfer failed (request r1: expected " in caplog.text
    assert "(stale or out-of-range destination)); policy recompute" in caplog.text
    # The regions the receive plan gave r1 (before the sender rewrote them): the receiver may
    # have filled those (they are r1's, now quarantined); nothing else may have changed.
    planned = backends[0].sent[1]
    with link.decode_lock:
        assert set(before) == {"kv", "conv", "ssm"}
        for kind, old in before.items():
            new = caches.pools()[kind]
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
        assert "r0" not in link.prefill.prefill_port.pending
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
    assert [h.request.request_id for h in engine.prefill_port.take_handoffs()] == ["r0", "r1"]
    engine.add_request(SPECS[2].prompt, SamplingParams(**GREEDY), request_id="r2")
    assert engine.step() == []  # nothing fits yet: wait, do not raise
    assert "r0" in engine.prefill_port.pending
    time.sleep(0.55)
    outputs = engine.step()  # the leases expire first, then r2 is admitted
    assert [o.request_id for o in outputs] == ["r2"]
    assert [h.request.request_id for h in engine.prefill_port.take_handoffs()] == ["r2"]
    assert "r0" not in engine.prefill_port.pending and "r1" not in engine.prefill_port.pending
    engine.check_integrity()
    time.sleep(0.55)  # r2's lease
    assert engine.step() == []
    assert not engine.has_pending_transfers()
    assert_pools_at_baseline(engine)
