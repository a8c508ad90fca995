"""A real prefill engine and a real decode engine wired through TransferSender /
TransferReceiver on loopback, driven step by step: the harness of the transfer fault tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridserve.transceiver.endpoint import SendOutcome, TransferReceiver, TransferSender
from hybridserve.transceiver.protocol import TransferRequest
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from hybridserve.workers.core.outputs import RequestOutput
from hybridserve.workers.disaggregation.prefill_port import Handoff
from tests.helpers import assert_pools_at_baseline, random_prompts

ENGINE_ARGS: dict[str, Any] = {
    "block_size": 16,
    "max_num_seqs": 4,
    "num_kv_blocks": 32,
    "max_model_len": 96,
    "enable_prefix_caching": True,
}
LEASE = 0.3  # prefill's transfer_lease_seconds: short, so the tests can wait it out
TIMEOUT = 2.0  # both endpoints' deadline unless a scenario provokes a timeout
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 4, "temperature": 0.9, "top_p": 0.9, "ignore_eos": True}


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: list[int]
    params: dict[str, Any]


def _specs() -> list[Spec]:
    prompts = random_prompts([37, 50, 21, 44], seed=11)  # 3, 4, 2 and 3 blocks of 16
    params = [GREEDY, SEEDED | {"seed": 5}, GREEDY, SEEDED | {"seed": 9}]
    return [Spec(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]


SPECS = _specs()


def colocated_tokens(checkpoint: str, **args: Any) -> dict[str, list[int]]:
    """Each request's tokens from one colocated engine with `args`."""
    engine = Engine(EngineConfig(model=checkpoint, **ENGINE_ARGS | args))
    for spec in SPECS:
        engine.add_request(spec.prompt, SamplingParams(**spec.params), request_id=spec.request_id)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    assert all(len(t) == 4 for t in tokens.values()) and len(tokens) == len(SPECS)
    return tokens


@dataclass
class Link:
    prefill: Engine
    decode: Engine
    sender: TransferSender
    receiver: TransferReceiver
    prefill_lock: threading.Lock
    decode_lock: threading.Lock

    # ---- prefill side -----------------------------------------------------------------------

    def hand_off(self, specs: list[Spec]) -> list[Handoff]:
        """Run the prompts on the prefill engine until each is handed off (first token out)."""
        for spec in specs:
            self.prefill.add_request(
                spec.prompt, SamplingParams(**spec.params), request_id=spec.request_id
            )
        handoffs: list[Handoff] = []
        while self.prefill.has_unfinished_requests():
            with self.prefill_lock:
                self.prefill.step()
                handoffs += self.prefill.prefill_port.take_handoffs()
        assert [h.request.request_id for h in handoffs] == [s.request_id for s in specs]
        return handoffs

    def send(self, handoff: Handoff, message: TransferRequest | None = None) -> SendOutcome:
        rid = handoff.request.request_id
        outcome = self.sender.send(rid, message or handoff.message)
        self.settle()
        return outcome

    def transfer(self, specs: list[Spec]) -> list[SendOutcome]:
        return [self.send(h) for h in self.hand_off(specs)]

    # ---- decode side ------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until the receiver's thread has finished with every transfer (it runs on after
        the sender has given up)."""
        wait_until(lambda: not self.decode.decode_port.receiving, "the receiver to settle")

    def decode_all(self) -> dict[str, RequestOutput]:
        """Step the decode engine until it has nothing left; every request's final output."""
        self.settle()
        finished: dict[str, RequestOutput] = {}
        while True:
            with self.decode_lock:
                if not self.decode.has_unfinished_requests():
                    break
                outputs = self.decode.step()
            for out in outputs:
                if out.finished:
                    assert out.request_id not in finished, "two final outputs"
                    finished[out.request_id] = out
        return finished

    # ---- both -------------------------------------------------------------------------------

    def assert_at_baseline(self) -> None:
        """Integrity now; once the lease (and any quarantine) has passed, all pages free."""
        for engine, lock in ((self.prefill, self.prefill_lock), (self.decode, self.decode_lock)):
            with lock:
                engine.check_integrity()

            def idle(engine: Engine = engine, lock: threading.Lock = lock) -> bool:
                with lock:
                    engine.step()  # an idle step still sweeps expired leases / quarantines
                    return not engine.has_pending_transfers()

            wait_until(idle, "leases and quarantines to pass", timeout=LEASE + 3.0)
            with lock:
                assert not engine.has_unfinished_requests()
                assert_pools_at_baseline(engine)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_recomputed_or_failed(
    finished: dict[str, RequestOutput],
    expected: dict[str, list[int]],
    policy: str,
    failed: dict[str, str],
) -> None:
    """`failed` maps each request whose transfer failed to a fragment of the reason: under
    `recompute` its tokens equal the colocated run, under `fail` it ends with an error."""
    assert set(finished) == set(expected)
    for rid, out in finished.items():
        if rid in failed and policy == "fail":
            assert out.finish_reason == "error", rid
            assert out.error is not None and out.error.startswith("KV transfer failed: "), rid
            assert failed[rid] in out.error, (rid, out.error)
            assert out.token_ids == expected[rid][:1]  # the prefill's first token only
        else:
            assert (out.finish_reason, out.error) == ("length", None), rid
            assert out.token_ids == expected[rid], rid
