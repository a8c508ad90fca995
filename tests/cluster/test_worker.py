"""EngineWorker without Ray: colocated runs, prefill -> decode hand-over, a transfer that never
lands, cancellation and drain. Oracle: an offline colocated engine; pools back at baseline."""

from __future__ import annotations

import asyncio
import functools
import itertools
from typing import Any

import pytest

from hybridserve.cluster.messages import GenerateRequest, PrefillResult, TokenEvent
from hybridserve.cluster.worker import EngineUnavailable, EngineWorker
from hybridserve.workers import LLM, EngineConfig, SamplingParams

ENGINE = {"model": "tiny", "max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 512}
PROMPT = [(5 * i + 1) % 250 for i in range(70)]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
_ids = itertools.count()


def request(prompt: list[int] = PROMPT, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(f"r{next(_ids)}", prompt, GREEDY | sampling)


def worker(role: str, name: str | None = None, **options: Any) -> EngineWorker:
    return EngineWorker(
        name or role, EngineConfig(**ENGINE, role=role), transfer_timeout=5.0, **options
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


def assert_idle_at_baseline(*workers: EngineWorker) -> None:
    for w in workers:
        report = w.check_integrity()
        assert not report["busy"], w.name
        assert report["num_free_blocks"] == report["num_blocks"], w.name
        assert report["num_free_slots"] == report["num_live_slots"], w.name


@pytest.fixture(scope="module")
def pair():
    # The decode endpoint binds and advertises the address it is given (the service gives
    # each engine its node's): another loopback address here, never a built-in 127.0.0.1.
    prefill, decode = worker("prefill"), worker("decode", transfer_host="127.0.0.2")
    assert decode.address is not None and decode.address[0] == "127.0.0.2"
    assert decode.describe()["address"][0] == "127.0.0.2"
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_colocated_generate_equals_offline():
    colocated = worker("colocated")
    try:
        events = asyncio.run(collect(colocated.generate(request())))
        assert tokens_of(events) == offline()
        assert events[-1].finish_reason == "length"
        assert_idle_at_baseline(colocated)
    finally:
        colocated.shutdown()


def test_prefill_hands_over_to_decode_with_the_same_tokens(pair):
    prefill, decode = pair

    async def run(req: GenerateRequest) -> tuple[list[TokenEvent], list[dict]]:
        results = []

        async def via_prefill(address: tuple[str, int]) -> dict:
            results.append(await prefill.prefill(req, address))
            return results[-1]

        return await collect(decode.continue_from(req, via_prefill)), results

    for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        events, (result,) = asyncio.run(run(request(**sampling)))
        assert PrefillResult.from_dict(result).status == "handed_off"
        assert tokens_of(events) == offline(**sampling)
    assert prefill.transfer_stats["bytes"] > 0
    assert_idle_at_baseline(prefill, decode)


def test_a_transfer_that_never_lands_is_recomputed_on_decode(pair):
    prefill, decode = pair
    req = request()

    async def unreachable(address: tuple[str, int]) -> dict:
        # A prefill engine told to send to a port nobody listens on.
        return await prefill.prefill(req, ("127.0.0.1", 1))

    events = asyncio.run(collect(decode.continue_from(req, unreachable)))
    assert tokens_of(events) == offline()
    assert decode.transfer_failures == {"recomputed": 1}
    assert prefill.transfer_failures == {"failed": 1}
    assert_idle_at_baseline(prefill, decode)


def test_an_invalid_request_is_an_error_event_not_a_crash(pair):
    prefill, decode = pair
    bad = request(prompt=[*PROMPT, 10_000])  # outside the vocabulary

    async def via_prefill(address: tuple[str, int]) -> dict:
        return await prefill.prefill(bad, address)

    (event,) = asyncio.run(collect(decode.continue_from(bad, via_prefill)))
    assert event.finish_reason == "error" and "outside the vocabulary" in event.error
    assert_idle_at_baseline(prefill, decode)


def test_a_consumer_that_stops_early_aborts_the_request():
    colocated = worker("colocated")
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
    colocated = worker("colocated")
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
