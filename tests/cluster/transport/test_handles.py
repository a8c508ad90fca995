"""RemoteEngine (cluster/transport/handles.py): an engine's calls and events through this replica's
feed from it. Both ends over loopback TCP: real FeedServers in front of real EngineHosts (tiny
model), a whole disaggregated request through the orchestrator (oracle: offline; pools back
at baseline). A prefill's first token and its result in either order, and its failures,
against a scripted engine (the code under test is the handle's)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hybridserve.cluster.messages import (
    GenerateRequest,
    PrefillResult,
    TokenBatch,
    TokenEvent,
)
from hybridserve.cluster.orchestrator import EngineDied, FeedLost, Orchestrator
from hybridserve.cluster.transport.handles import RemoteEngine
from hybridserve.cluster.transport.token_feed import EngineCallFailed, EngineFeed
from tests.cluster.engine_host.test_host import (
    PROMPT,
    FixedRoute,
    assert_idle_at_baseline,
    collect,
    offline,
    request,
    tokens_of,
)
from tests.cluster.transport.test_feed_server import feed_server
from tests.cluster.transport.test_token_feed import FeedServerEndpoint, ScriptedEngine

ROLES = ("prefill", "decode")


def test_a_disaggregated_request_runs_through_both_engines_feeds(pd_hosts):
    prefill, decode = pd_hosts
    router = FixedRoute(*ROLES)

    async def scenario() -> tuple[list[TokenEvent], list[TokenEvent]]:
        hosts = {"prefill": prefill, "decode": decode}
        servers = {name: feed_server(host) for name, host in hosts.items()}
        engines = {
            name: RemoteEngine(
                name, EngineFeed(name, FeedServerEndpoint(server)), hosts[name].address
            )
            for name, server in servers.items()
        }

        async def died(name: str) -> None:
            raise AssertionError(f"{name} reported dead")

        orchestrator = Orchestrator(router, engines, died)
        events = await collect(orchestrator.run(request()))
        refused = await collect(orchestrator.run(request(prompt=[*PROMPT, 10_000])))
        for name, engine in engines.items():
            engine.feed.reading.cancel()
            while servers[name].sessions:
                await asyncio.sleep(0.01)
            servers[name].close()
        return events, refused

    events, refused = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert tokens_of(events) == offline()
    # The prefill engine refused it: one error event naming why; the decode engine's stream
    # was released.
    assert len(refused) == 1 and "outside the vocabulary" in refused[0].error
    assert router.held == []
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def scripted(alive: bool = False) -> tuple[RemoteEngine, ScriptedEngine]:
    engine = ScriptedEngine(alive)
    engine.script.put_nowait(TokenBatch([]))
    return RemoteEngine("prefill-0", EngineFeed("prefill-0", engine)), engine


async def prefill_messages(engine: RemoteEngine, req: GenerateRequest) -> list[Any]:
    return [m async for m in engine.prefill(req, ("127.0.0.1", 1))]


def test_a_reply_ahead_of_the_first_token_waits_for_it():
    """The transfer can finish before the token's batch comes: the token still goes first."""
    req = request()
    result = PrefillResult(req.request_id, "handed_off", blocks_sent=2)
    first = TokenEvent(req.request_id, 0, [7])

    async def scenario() -> list[Any]:
        engine, script = scripted()
        run = asyncio.ensure_future(prefill_messages(engine, req))
        call = await script.reply(result.to_dict())
        assert (call.method, call.args[0]["request_id"]) == ("prefill", req.request_id)
        await asyncio.sleep(0.1)  # the reply is in; the token is not
        assert not run.done()
        script.script.put_nowait(TokenBatch([first]))
        return await run

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [first, result]


def test_a_refused_prefill_yields_its_result_alone():
    req = request()
    refused = PrefillResult(req.request_id, "error", detail="token id 10000 is outside")

    async def scenario() -> list[Any]:
        engine, script = scripted()
        run = asyncio.ensure_future(prefill_messages(engine, req))
        await script.reply(refused.to_dict())
        return await run

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [refused]


def test_a_prefill_the_engine_cannot_take_raises_its_error():
    async def scenario() -> None:
        engine, script = scripted()
        run = asyncio.ensure_future(prefill_messages(engine, request()))
        await script.reply(error="EngineUnavailable: shutting down")
        await run

    with pytest.raises(EngineCallFailed, match="prefill-0: EngineUnavailable: shutting down"):
        asyncio.run(asyncio.wait_for(scenario(), 10))


@pytest.mark.parametrize("alive", [False, True], ids=["engine died", "feed lost"])
def test_a_feed_that_ends_before_the_first_token_fails_the_request(alive):
    """Dead engine: EngineDied (it is restarted). Live engine, broken feed: FeedLost (only
    the request fails)."""
    req = request()

    async def scenario() -> None:
        engine, script = scripted(alive)
        run = asyncio.ensure_future(prefill_messages(engine, req))
        if alive:  # the transfer went, then the connection broke
            await script.reply(PrefillResult(req.request_id, "handed_off").to_dict())
        else:
            await script.calls.get()
        script.script.put_nowait(ConnectionResetError())
        await run

    with pytest.raises(FeedLost if alive else EngineDied, match="prefill-0"):
        asyncio.run(asyncio.wait_for(scenario(), 10))
