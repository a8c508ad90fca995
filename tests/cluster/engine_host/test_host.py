"""EngineHost without Ray: colocated runs, prefill -> decode hand-over, a transfer that never
lands, cancellation and drain. Oracle: an offline colocated engine; pools back at baseline."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from typing import Any

import pytest
import torch

from hybridserve.cluster.engine_host import host as host_module
from hybridserve.cluster.engine_host.host import EngineHost, EngineUnavailable
from hybridserve.cluster.messages import GenerateRequest, PrefillResult, Route, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied, FeedLost, Orchestrator
from hybridserve.cluster.transport.token_feed import EngineCallFailed
from hybridserve.workers import LLM, EngineConfig, SamplingParams
from tests.helpers import TRANSFER_SECRET

ENGINE = {"model": "tiny", "max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 512}
PROMPT = [(5 * i + 1) % 250 for i in range(70)]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
_ids = itertools.count()


def request(prompt: list[int] = PROMPT, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(f"r{next(_ids)}", prompt, GREEDY | sampling)


def engine_host(role: str, name: str | None = None, **options: Any) -> EngineHost:
    return EngineHost(
        name or role,
        EngineConfig(**ENGINE, role=role, transfer_secret=TRANSFER_SECRET),
        transfer_timeout=5.0,
        **options,
    )


def tokens_of(events: list[TokenEvent]) -> list[int]:
    out: list[int] = []
    for event in events:
        assert event.offset == len(out)
        out.extend(event.token_ids)
    return out


async def collect(stream: Any) -> list[TokenEvent]:
    return [event async for event in stream]


@functools.cache
def colocated_llm() -> LLM:
    """The oracle engine, built once for the module (each request leaves it idle)."""
    return LLM(**ENGINE)


def offline(prompt: list[int] = PROMPT, **sampling: Any) -> list[int]:
    (out,) = colocated_llm().generate([prompt], SamplingParams(**(GREEDY | sampling)))
    return out.token_ids


def assert_idle_at_baseline(*hosts: EngineHost) -> None:
    for w in hosts:
        report = w.check_integrity()
        assert not report["busy"], w.name
        assert report["num_free_blocks"] == report["num_blocks"], w.name
        assert report["num_free_slots"] == report["num_live_slots"], w.name


def assert_settled_at_baseline(*hosts: EngineHost) -> None:
    """Idle at baseline within seconds, with no stream left: a transfer cut off mid-way
    settles on its own (the decode engine fails the receive, its pages wait out a late
    write)."""
    deadline = time.monotonic() + 30
    while any(w.check_integrity()["busy"] for w in hosts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(w._streams == {} for w in hosts)
    assert_idle_at_baseline(*hosts)


@pytest.fixture(scope="module")
def pair():
    # The decode endpoint binds and advertises the address it is given (the service gives
    # each engine its node's): another loopback address here, never a built-in 127.0.0.1.
    prefill, decode = engine_host("prefill"), engine_host("decode", transfer_host="127.0.0.2")
    assert decode.address is not None and decode.address[0] == "127.0.0.2"
    assert decode.describe()["address"][0] == "127.0.0.2"
    # Its stepping thread runs the C kernels on torch's threads (tests/kernels/cpu/test_build.py).
    assert decode.describe()["cpu_threads"] == torch.get_num_threads()
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_colocated_generate_equals_offline():
    colocated = engine_host("colocated")
    try:
        events = asyncio.run(collect(colocated.generate(request())))
        assert tokens_of(events) == offline()
        assert events[-1].finish_reason == "length"
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


def test_a_core_binding_given_up_on_is_skipped_and_the_engine_keeps_stepping():
    """An engine actor that stops waiting for a binding gives its cores back and cancels it:
    the stepping thread must skip it (and not die on it), then make the next one."""
    colocated = engine_host("colocated")
    try:
        cores = colocated.team_cores()
        with colocated.lock:  # the stepping thread goes round and waits here
            colocated._wake.set()
            time.sleep(0.5)
            given_up = colocated.bind_cores(cores)
            assert given_up.cancel()
            wanted = colocated.bind_cores(cores)
        assert isinstance(wanted.result(timeout=10), bool)
        assert colocated.team_cores() == cores
        assert tokens_of(asyncio.run(collect(colocated.generate(request())))) == offline()
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


def test_a_stream_interval_sends_tokens_in_chunks_of_that_many():
    """The first token at once, then chunks of 3, the last one when the request ends; the
    same tokens and logprobs as one event per token."""
    colocated = engine_host("colocated", stream_interval=3)
    try:
        for max_tokens, sizes in ((10, [1, 3, 3, 3]), (9, [1, 3, 3, 2])):
            req = request(max_tokens=max_tokens, logprobs=2)
            events = asyncio.run(collect(colocated.generate(req)))
            assert [len(e.token_ids) for e in events] == sizes
            assert tokens_of(events) == offline(max_tokens=max_tokens)
            assert all(len(e.logprobs or []) == len(e.token_ids) for e in events)
            assert events[-1].finish_reason == "length"
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


class FixedRoute:
    """A router that always picks the same pair (the orchestrator's other input)."""

    def __init__(self, prefill: str | None, decode: str) -> None:
        self.choice = Route(prefill, decode, expected_cached_tokens=0, reason="test")
        self.held: list[str] = []

    async def route(self, token_ids: list[int], cache_salt: str | None) -> Route:
        self.held += self.choice.engines
        return self.choice

    async def release(self, engine: str) -> None:
        self.held.remove(engine)


class Unreachable:
    """The decode engine, but giving the prefill engine an address nobody listens on."""

    def __init__(self, decode: EngineHost) -> None:
        self.decode = decode

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decode, name)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", 1)


class FailsOnPrefill:
    """A prefill engine whose prefill fails at once with `error`: dead (EngineDied), or its
    connection to the replica broke while it lives (FeedLost)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"an unreachable engine got {name}")

    async def prefill(self, request: GenerateRequest, address: tuple[str, int]) -> Any:
        raise self.error
        yield  # an async generator, as an engine's prefill is


def orchestrate(engines: dict[str, Any], req: GenerateRequest, dead: list[str] | None = None):
    router = FixedRoute("prefill" if "prefill" in engines else None, "decode")

    async def died(name: str) -> None:
        (dead if dead is not None else []).append(name)

    events = asyncio.run(collect(Orchestrator(router, engines, died).run(req)))
    assert router.held == []  # every engine's load was released
    return events


def test_prefill_hands_over_to_decode_with_the_same_tokens(pair):
    """Each token exactly once (tokens_of checks the offsets): the first from the prefill
    engine, the rest from the decode engine."""
    prefill, decode = pair
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        events = orchestrate({"prefill": prefill, "decode": decode}, request(**sampling))
        assert tokens_of(events) == offline(**sampling)
    assert prefill.links.bytes_sent > 0
    assert_idle_at_baseline(prefill, decode)


def test_a_decode_engine_s_stream_interval_chunks_what_follows_the_first_token(pair):
    prefill, decode = pair
    decode.stream_interval = 3
    try:
        events = orchestrate({"prefill": prefill, "decode": decode}, request(max_tokens=10))
    finally:
        decode.stream_interval = 1
    assert [len(e.token_ids) for e in events] == [1, 3, 3, 3]
    assert tokens_of(events) == offline(max_tokens=10)
    assert_idle_at_baseline(prefill, decode)


class ReportsWhenReleased:
    """The prefill engine, but its result (how the transfer went) waits for `released`."""

    def __init__(self, prefill: EngineHost) -> None:
        self.prefill_engine = prefill
        self.released = asyncio.Event()

    async def prefill(self, request: GenerateRequest, address: tuple[str, int]) -> Any:
        async for message in self.prefill_engine.prefill(request, address):
            if isinstance(message, PrefillResult):
                await self.released.wait()
            yield message


def test_the_first_token_goes_out_before_the_transfer_is_reported(pair):
    prefill, decode = pair
    router = FixedRoute("prefill", "decode")

    async def scenario() -> list[TokenEvent]:
        held = ReportsWhenReleased(prefill)
        events = Orchestrator(router, {"prefill": held, "decode": decode}, died).run(request())
        first = await asyncio.wait_for(anext(events), 30)  # no result yet
        assert router.held == ["prefill", "decode"]  # the prefill engine's load still counts
        held.released.set()
        return [first, *[event async for event in events]]

    async def died(name: str) -> None:
        raise AssertionError(f"{name} reported dead")

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert router.held == []
    assert_idle_at_baseline(prefill, decode)


def test_a_transfer_that_never_lands_is_recomputed_on_decode(pair):
    prefill, decode = pair
    events = orchestrate({"prefill": prefill, "decode": Unreachable(decode)}, request())
    assert tokens_of(events) == offline()
    assert decode.stats()["transfer_failures"] == {"transfer_failed": 1}
    assert prefill.stats()["transfer_failures"] == {"failed": 1}
    assert_idle_at_baseline(prefill, decode)


def test_the_decode_engine_s_policy_fail_ends_a_failed_transfer_with_an_error(pair):
    prefill = pair[0]
    decode = EngineHost(
        "strict",
        EngineConfig(
            **ENGINE,
            role="decode",
            transfer_failure_policy="fail",
            transfer_secret=TRANSFER_SECRET,
        ),
        transfer_timeout=5.0,
    )
    try:
        events = orchestrate({"prefill": prefill, "decode": Unreachable(decode)}, request())
        assert events[-1].finish_reason == "error" and "KV transfer failed" in events[-1].error
        assert tokens_of(events) == offline()[:1]  # the first token, from prefill
        assert_idle_at_baseline(prefill, decode)
    finally:
        decode.shutdown()


def test_a_dead_prefill_engine_is_reported_and_decode_recomputes(pair):
    """The prefill engine's death fails only its transfer: the decode engine (healthy) runs
    the request itself, and only the prefill engine is reported dead."""
    decode = pair[1]
    dead: list[str] = []
    events = orchestrate(
        {"prefill": FailsOnPrefill(EngineDied("prefill")), "decode": decode}, request(), dead
    )
    assert tokens_of(events) == offline()
    assert dead == ["prefill"]
    assert_idle_at_baseline(decode)


def test_a_lost_prefill_feed_fails_only_the_transfer_and_decode_recomputes(pair):
    """Recovered like a dead prefill engine, but the engine, alive, is not reported dead."""
    decode = pair[1]
    dead: list[str] = []
    lost = FeedLost("the token feed from engine prefill was lost: reset")
    events = orchestrate({"prefill": FailsOnPrefill(lost), "decode": decode}, request(), dead)
    assert tokens_of(events) == offline()
    assert dead == []
    assert_idle_at_baseline(decode)


class DiesAfterHandingOff:
    """A prefill engine killed after its transfer landed but before its messages reached the
    caller: the decode engine runs the request from the transferred state (its stream starts
    after the first token, and has queued later ones), and the caller never got the first."""

    def __init__(self, prefill: EngineHost, decode: EngineHost) -> None:
        self.prefill_engine, self.decode = prefill, decode

    async def prefill(self, request: GenerateRequest, address: tuple[str, int]) -> Any:
        async for _ in self.prefill_engine.prefill(request, address):
            pass  # lost: the first token and the result
        stream = self.decode._streams[request.request_id]
        for _ in range(500):  # until the decode engine queued a token after the first
            if stream.queue.qsize():
                break
            await asyncio.sleep(0.01)
        assert stream.queue.qsize(), "the decode engine never decoded the transferred request"
        raise EngineDied("prefill")
        yield  # an async generator, as an engine's prefill is


@pytest.mark.parametrize("sampling", [{}, {"logprobs": 2}])
def test_a_prefill_engine_dying_after_its_transfer_landed_loses_no_token(pair, sampling):
    """The caller gets the first token from the decode engine, ahead of the ones it queued,
    and every token exactly once (with its logprobs when asked for)."""
    prefill, decode = pair
    dead: list[str] = []
    sent_before = prefill.links.bytes_sent
    engines = {"prefill": DiesAfterHandingOff(prefill, decode), "decode": decode}
    events = orchestrate(engines, request(**sampling), dead)
    assert tokens_of(events) == offline(**sampling)
    if sampling:
        logprobs = [entry for event in events for entry in event.logprobs or []]
        assert [entry[0] for entry in logprobs] == offline(**sampling)
    assert dead == ["prefill"]
    assert prefill.links.bytes_sent > sent_before  # the state did travel
    assert_idle_at_baseline(prefill, decode)


def test_a_request_ended_by_its_first_token_leaves_nothing_on_either_engine(pair):
    prefill, decode = pair
    events = orchestrate({"prefill": prefill, "decode": decode}, request(max_tokens=1))
    assert tokens_of(events) == offline(max_tokens=1)
    assert events[-1].finish_reason == "length"
    assert prefill._streams == {} and decode._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_caller_gone_after_the_first_token_leaves_nothing_on_either_engine(pair):
    """The transfer may be in flight then: both engines drop the request."""
    prefill, decode = pair
    router = FixedRoute("prefill", "decode")

    async def first_then_stop() -> TokenEvent:
        events = Orchestrator(router, {"prefill": prefill, "decode": decode}, died).run(
            request(max_tokens=400)
        )
        first = await anext(events)
        await events.aclose()
        return first

    async def died(name: str) -> None:
        raise AssertionError(f"{name} reported dead")

    first = asyncio.run(first_then_stop())
    assert first.token_ids == offline()[:1]
    assert router.held == []
    assert prefill._streams == {} and decode._streams == {}
    assert_settled_at_baseline(prefill, decode)


class DiesAfterTheFirstToken:
    """A prefill engine killed after its first token reached the caller, before it said how
    the transfer went (which may land or not): the decode engine continues from the token
    after the first, by the transferred state or a recompute."""

    def __init__(self, prefill: EngineHost) -> None:
        self.prefill_engine = prefill

    async def prefill(self, request: GenerateRequest, address: tuple[str, int]) -> Any:
        async with contextlib.aclosing(self.prefill_engine.prefill(request, address)) as run:
            yield await anext(run)
        raise EngineDied("prefill")


def test_a_prefill_engine_dying_after_its_first_token_loses_no_token(pair):
    prefill, decode = pair
    dead: list[str] = []
    events = orchestrate(
        {"prefill": DiesAfterTheFirstToken(prefill), "decode": decode}, request(), dead
    )
    assert tokens_of(events) == offline()
    assert dead == ["prefill"]
    assert_idle_at_baseline(prefill, decode)


class ExpectsAfterTheTransfer:
    """The decode engine, its `expect` held back until the prefill engine's transfer has
    reached it and waits there (the orchestrator sends both at once: either may land first)."""

    def __init__(self, decode: EngineHost) -> None:
        self.decode = decode
        self.waiting: list[str] = []  # requests whose transfer asked before their expect
        receiver = decode.links.receiver
        assert receiver is not None and receiver.admit is not None
        self.admit = receiver.admit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decode, name)

    def arrived(self, request_id: str) -> bool:
        self.waiting.append(request_id)
        return self.admit(request_id)

    async def expect(self, request_id: str, num_choices: int = 1) -> None:
        while request_id not in self.waiting:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # were it not held, the transfer would land and decode now
        await self.decode.expect(request_id, num_choices)


def test_a_transfer_that_arrives_before_its_expect_waits_for_it(pair):
    prefill, decode = pair
    late = ExpectsAfterTheTransfer(decode)
    receiver = decode.links.receiver
    receiver.admit = late.arrived
    failures = prefill.links.failures()
    router = FixedRoute("prefill", "decode")

    async def died(name: str) -> None:
        raise AssertionError(f"{name} reported dead")

    try:
        req = request()
        run = Orchestrator(router, {"prefill": prefill, "decode": late}, died).run(req)
        events = asyncio.run(asyncio.wait_for(collect(run), 30))
    finally:
        receiver.admit = late.admit
    assert late.waiting == [req.request_id]
    assert tokens_of(events) == offline()
    assert prefill.links.failures() == failures  # it landed: no recompute
    assert router.held == []
    assert_idle_at_baseline(prefill, decode)


def test_a_transfer_nobody_expects_is_refused_and_holds_nothing(pair, monkeypatch):
    prefill, decode = pair
    monkeypatch.setattr(host_module, "EXPECT_WAIT_S", 0.2)

    async def unexpected() -> list[TokenEvent | PrefillResult]:
        return [message async for message in prefill.prefill(request(), decode.address)]

    first, result = asyncio.run(unexpected())
    assert isinstance(first, TokenEvent) and first.token_ids == offline()[:1]
    assert result.status == "transfer_failed" and "not_expected" in result.detail
    assert_idle_at_baseline(prefill, decode)


def test_a_transfer_of_a_request_whose_caller_left_is_refused_at_once(pair, monkeypatch):
    """Its stream came (expect) and went (release) before the transfer arrived: the link
    does not wait for an expect that will not come."""
    prefill, decode = pair
    monkeypatch.setattr(host_module, "EXPECT_WAIT_S", 60.0)

    async def left() -> list[TokenEvent | PrefillResult]:
        req = request()
        await decode.expect(req.request_id)
        await decode.release(req.request_id)
        return [message async for message in prefill.prefill(req, decode.address)]

    _, result = asyncio.run(asyncio.wait_for(left(), 20))
    assert result.status == "transfer_failed" and "not_expected" in result.detail
    assert_idle_at_baseline(prefill, decode)


class RefusesToExpect:
    """The decode engine, refusing the request's expect (the prefill is under way by then)."""

    def __init__(self, decode: EngineHost) -> None:
        self.decode = decode

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decode, name)

    async def expect(self, request_id: str, num_choices: int = 1) -> None:
        raise EngineCallFailed(f"engine decode: ValueError: request id {request_id!r} is in use")


def test_a_refused_expect_ends_the_request_and_aborts_its_prefill(pair):
    prefill, decode = pair
    router = FixedRoute("prefill", "decode")

    async def died(name: str) -> None:
        raise AssertionError(f"{name} reported dead")

    async def scenario() -> None:
        engines = {"prefill": prefill, "decode": RefusesToExpect(decode)}
        with pytest.raises(EngineCallFailed, match="is in use"):
            await collect(Orchestrator(router, engines, died).run(request(max_tokens=400)))

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert router.held == []
    assert_settled_at_baseline(prefill, decode)


def test_an_invalid_request_is_an_error_event_not_a_crash(pair):
    prefill, decode = pair
    bad = request(prompt=[*PROMPT, 10_000])  # outside the vocabulary
    (event,) = orchestrate({"prefill": prefill, "decode": decode}, bad)
    assert event.finish_reason == "error" and "outside the vocabulary" in event.error
    assert_idle_at_baseline(prefill, decode)


def test_a_consumer_that_stops_early_aborts_the_request():
    colocated = engine_host("colocated")
    try:

        async def first_then_stop() -> None:
            stream = colocated.generate(request(max_tokens=400))
            await anext(stream)
            await stream.aclose()

        asyncio.run(first_then_stop())
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


def test_drain_cuts_off_running_requests_with_an_error_and_refuses_new_ones():
    colocated = engine_host("colocated")
    try:

        async def scenario() -> tuple[list[TokenEvent], int]:
            stream = colocated.generate(request(max_tokens=400))
            first = await anext(stream)
            cut = await colocated.drain(timeout=0.05)
            rest = [first, *[e async for e in stream]]
            return rest, cut

        events, cut = asyncio.run(scenario())
        assert cut == 1
        assert events[-1].finish_reason == "error" and "shut down" in events[-1].error
        with pytest.raises(EngineUnavailable, match="shutting down"):
            asyncio.run(collect(colocated.generate(request())))
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_engine_host_without_the_deployment_secret_refuses_to_start(role):
    with pytest.raises(ValueError, match=f"a {role} engine needs transfer_secret"):
        EngineHost(role, EngineConfig(**ENGINE, role=role))


def test_an_engine_that_cannot_be_built_fails_the_engine_host_and_leaves_no_thread():
    """The engine is built on the stepping thread: its error reaches the constructor."""
    config = EngineConfig(**(ENGINE | {"num_kv_blocks": 1}), role="colocated")
    with pytest.raises(ValueError, match="the KV pool has 1 blocks"):
        EngineHost("unbuildable", config)
    assert not [t for t in threading.enumerate() if t.name == "unbuildable-step"]
