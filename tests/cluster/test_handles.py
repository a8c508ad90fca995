"""RayEngine's prefill (cluster/handles.py): its first token from the replica's feed, its
result from the call's reply, in either order. Engine and replica ends together over
loopback TCP (a real FeedServer and EngineWorkers; oracle: offline), and the orderings and
failures with a scripted engine (the code under test is the handle's)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import RayActorError

from hybridserve.cluster.handles import RayEngine
from hybridserve.cluster.messages import GenerateRequest, PrefillResult, TokenBatch, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied
from hybridserve.cluster.token_feed import EngineFeed, FeedLost, FeedServer
from tests.cluster.test_token_feed import FeedServerHandle, ScriptedEngine, pair  # noqa: F401
from tests.cluster.test_worker import assert_idle_at_baseline, offline, request, tokens_of


class PrefillActor(FeedServerHandle):
    """Stands in for an engine actor handle over a real FeedServer: `prefill` does what the
    actor's method does."""

    def __init__(self, server: FeedServer) -> None:
        super().__init__(server)
        self.prefill = SimpleNamespace(remote=self._prefill)

    async def _prefill(
        self, request: dict[str, Any], address: list[Any], subscriber: str
    ) -> dict[str, Any]:
        outbox = self.server.outbox(subscriber)
        result = await outbox.prefill(GenerateRequest.from_dict(request), tuple(address))
        return result.to_dict()


def replying(result: PrefillResult | BaseException, after_s: float = 0.0) -> SimpleNamespace:
    """A scripted `prefill` method: its reply, `after_s` seconds after the call."""

    async def remote(*_: Any) -> dict[str, Any]:
        await asyncio.sleep(after_s)
        if isinstance(result, BaseException):
            raise result
        return result.to_dict()

    return SimpleNamespace(remote=remote)


async def messages(engine: RayEngine, req: GenerateRequest) -> list[Any]:
    return [m async for m in engine.prefill(req, ("127.0.0.1", 1))]


def test_the_first_token_comes_from_the_feed_and_the_result_from_the_reply(pair):  # noqa: F811
    prefill, decode = pair

    async def scenario() -> list[TokenEvent]:
        server = FeedServer(prefill, "127.0.0.1")
        actor = PrefillActor(server)
        engine = RayEngine("prefill", actor, EngineFeed("prefill", actor))
        req = request()
        address = await decode.expect(req.request_id)
        first, result = [m async for m in engine.prefill(req, address)]
        assert isinstance(first, TokenEvent) and result.status == "handed_off"
        events = [first, *[e async for e in decode.follow(req.request_id)]]
        engine.feed.reading.cancel()
        while server.outboxes:
            await asyncio.sleep(0.01)
        server.close()
        return events

    assert tokens_of(asyncio.run(asyncio.wait_for(scenario(), 30))) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def scripted(reply: SimpleNamespace, *batches: TokenBatch | BaseException, alive: bool = False):
    engine = ScriptedEngine(alive)
    engine.prefill = reply
    for batch in (TokenBatch([]), *batches):
        engine.script.put_nowait(batch)
    return RayEngine("prefill-0", engine, EngineFeed("prefill-0", engine))


def test_a_reply_ahead_of_the_first_token_waits_for_it():
    """The transfer can finish before the feed delivers: the token still comes first."""
    req = request()
    result = PrefillResult(req.request_id, "handed_off", blocks_sent=2)
    first = TokenEvent(req.request_id, 0, [7])

    async def scenario() -> list[Any]:
        engine = scripted(replying(result))
        run = asyncio.ensure_future(messages(engine, req))
        await asyncio.sleep(0.1)  # the reply is in; the token is not
        assert not run.done()
        engine.handle.script.put_nowait(TokenBatch([first]))
        return await run

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [first, result]


def test_a_refused_prefill_yields_its_result_alone():
    req = request()
    refused = PrefillResult(req.request_id, "error", detail="token id 10000 is outside")
    engine_messages = asyncio.run(asyncio.wait_for(messages(scripted(replying(refused)), req), 10))
    assert engine_messages == [refused]


def test_a_prefill_engine_that_dies_is_reported():
    engine = scripted(replying(RayActorError(), after_s=0.05))
    with pytest.raises(EngineDied, match="prefill-0"):
        asyncio.run(asyncio.wait_for(messages(engine, request()), 10))


def test_a_feed_lost_before_the_first_token_fails_the_request_not_the_engine():
    req = request()
    handed_off = PrefillResult(req.request_id, "handed_off")
    engine = scripted(replying(handed_off), ConnectionResetError(), alive=True)
    with pytest.raises(FeedLost, match="prefill-0"):
        asyncio.run(asyncio.wait_for(messages(engine, req), 10))
