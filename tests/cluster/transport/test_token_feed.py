"""The replica end of the token feeds (cluster/transport/token_feed.py): EngineFeed against a
scripted engine (the code under test is the demultiplexing of events and replies, and the
engine's death), and both ends together over loopback TCP (a real FeedServer and EngineFeed,
with a real EngineHost; oracle: an offline engine)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from hybridserve.cluster.control.feed_endpoint import ActorEndpoint
from hybridserve.cluster.messages import (
    FeedCall,
    FeedHello,
    FeedReply,
    FeedTicket,
    TokenBatch,
    TokenEvent,
)
from hybridserve.cluster.orchestrator import EngineDied, FeedLost
from hybridserve.cluster.transport.feed_server import FeedServer
from hybridserve.cluster.transport.token_feed import (
    EngineCallFailed,
    EngineFeed,
    frame,
    read_frame,
)
from tests.cluster.engine_host.test_host import assert_idle_at_baseline, offline, request, tokens_of
from tests.cluster.transport.test_feed_server import OTHER_PROMPT, feed_server


class ScriptedEngine:
    """Stands in for an engine actor's endpoint: `subscribe` hands out a ticket for a TCP server
    of its own, which checks the hello, puts the calls it reads on `calls` and writes the
    batches put on `script` as frames (an exception closes the connection: the engine
    died). `deaths_reported` counts what the feed reported to the Coordinator (`on_death`)."""

    def __init__(self, alive: bool = False) -> None:
        self.deaths_reported = 0
        self.script: asyncio.Queue[TokenBatch | BaseException] = asyncio.Queue()
        self.calls: asyncio.Queue[FeedCall] = asyncio.Queue()
        self.lives = alive  # what `alive` answers once the connection broke
        self.subscribers: list[str] = []
        self.hellos: list[FeedHello] = []

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        self.subscribers.append(subscriber)
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return FeedTicket("127.0.0.1", server.sockets[0].getsockname()[1], "t-1").to_dict()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hellos.append(FeedHello.from_dict(await read_frame(reader)))
        reading = asyncio.ensure_future(self._read_calls(reader))
        while not isinstance(item := await self.script.get(), BaseException):
            writer.write(frame(item.to_dict()))
            await writer.drain()
        reading.cancel()
        writer.close()

    async def _read_calls(self, reader: asyncio.StreamReader) -> None:
        while True:
            self.calls.put_nowait(FeedCall.from_dict(await read_frame(reader)))

    async def alive(self) -> bool:
        return self.lives

    async def report_death(self) -> None:
        self.deaths_reported += 1

    async def reply(self, value: Any = None, error: str | None = None) -> FeedCall:
        """Answer the next call (once it came); returns it."""
        call = await self.calls.get()
        self.script.put_nowait(TokenBatch([], [FeedReply(call.call_id, value, error)]))
        return call


def scripted_feed(
    alive: bool = False, on_death: Callable[[], Awaitable[None]] | None = None
) -> tuple[EngineFeed, ScriptedEngine]:
    """A replica's feed from a scripted engine "decode-0", its first (empty) batch sent; its
    deaths are counted on the engine unless `on_death` takes them."""
    engine = ScriptedEngine(alive)
    engine.script.put_nowait(TokenBatch([]))
    return EngineFeed("decode-0", engine, on_death or engine.report_death), engine


async def ended(feed: EngineFeed) -> None:
    """Once the feed's reader has finished (what it reports included)."""
    assert feed.reading is not None
    with contextlib.suppress(asyncio.CancelledError):
        await feed.reading


class FeedServerEndpoint:
    """Stands in for an engine actor's endpoint over a real FeedServer: `subscribe` asks it
    for a ticket, as the actor's method does."""

    def __init__(self, server: FeedServer) -> None:
        self.server = server

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        return (await self.server.admit(subscriber)).to_dict()

    async def alive(self) -> bool:
        return True


def test_a_replica_reads_an_engine_s_batches_over_its_connection(colocated_host):
    """Engine and replica ends together over loopback TCP: the replica's requests stream
    their tokens (oracle: offline), and when the replica goes, what it left running is
    aborted."""
    requests = [request(), request(prompt=OTHER_PROMPT, max_tokens=400)]

    async def scenario() -> list[int]:
        server = feed_server(colocated_host)
        feed = EngineFeed("colocated", FeedServerEndpoint(server))
        queues = [await feed.open(r.request_id) for r in requests]
        for r in requests:
            server.sessions[feed.subscriber].submit(r)
        tokens = tokens_of([e async for e in feed.events(requests[0].request_id, queues[0])])
        # The replica goes away (its connection closes) while the long request still runs.
        feed.close(requests[1].request_id)
        feed.reading.cancel()
        while server.sessions:
            await asyncio.sleep(0.01)
        server.close()
        return tokens

    tokens = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert tokens == offline()
    assert colocated_host._streams == {}
    assert_idle_at_baseline(colocated_host)


def test_the_feed_hands_each_event_to_its_request_and_reports_the_engine_s_death():
    async def scenario() -> None:
        feed, engine = scripted_feed()
        a, b = await feed.open("a"), await feed.open("b")
        assert engine.subscribers == [feed.subscriber]  # one subscription for both
        assert engine.hellos == [FeedHello("t-1")]  # the ticket it was handed
        engine.script.put_nowait(
            TokenBatch(
                [
                    TokenEvent("a", 0, [1]),
                    TokenEvent("gone", 3, [9]),  # a request nobody waits for: dropped
                    TokenEvent("b", 0, [2]),
                    TokenEvent("a", 1, [3], finish_reason="length", last=True),
                ]
            )
        )
        assert tokens_of([e async for e in feed.events("a", a)]) == [1, 3]
        b_events = feed.events("b", b)
        assert (await anext(b_events)).token_ids == [2]
        engine.script.put_nowait(ConnectionResetError())
        with pytest.raises(EngineDied, match="decode-0"):
            await anext(b_events)
        assert feed.dead
        with pytest.raises(EngineDied, match="decode-0"):
            await feed.open("c")
        await ended(feed)
        assert engine.deaths_reported == 1

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_idle_feed_reports_its_engine_s_death():
    """No request is open when the engine dies: the feed still reports it, so the engine
    leaves routing now rather than at the Coordinator's next health check."""

    async def scenario() -> None:
        feed, engine = scripted_feed()
        queue = await feed.open("a")
        engine.script.put_nowait(
            TokenBatch([TokenEvent("a", 0, [1], finish_reason="length", last=True)])
        )
        assert tokens_of([e async for e in feed.events("a", queue)]) == [1]
        engine.script.put_nowait(ConnectionResetError())
        await ended(feed)
        assert feed.dead and feed.lost is None
        assert engine.deaths_reported == 1

    asyncio.run(asyncio.wait_for(scenario(), 10))


@pytest.mark.parametrize(
    ("error", "alive", "raised", "num_reports"),
    [
        (ActorDiedError(), False, EngineDied, 1),
        # The actor may come back (a RayActorError too): FeedLost, nothing reported.
        (ActorUnavailableError("unreachable", None), True, FeedLost, 0),
    ],
)
def test_a_failed_subscription_is_reported_only_if_the_actor_died(
    error, alive, raised, num_reports
):
    """Through the service's endpoint (cluster/control/feed_endpoint.py) over a Ray handle
    whose `subscribe` fails with `error` and whose `describe` fails as Ray's does for a dead
    actor, unless it is `alive`."""

    async def subscribe(subscriber: str) -> dict[str, Any]:
        raise error

    async def describe() -> dict[str, Any]:
        if not alive:
            raise RayActorError()
        return {}

    async def scenario() -> None:
        reports = []

        async def report() -> None:
            reports.append(1)

        handle = SimpleNamespace(
            subscribe=SimpleNamespace(remote=subscribe), describe=SimpleNamespace(remote=describe)
        )
        feed = EngineFeed("decode-0", ActorEndpoint(handle), report)
        with pytest.raises(raised, match="decode-0"):
            await feed.open("a")
        await ended(feed)
        assert len(reports) == num_reports

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_requests_end_before_the_death_is_reported():
    """The report (a Ray call to the Coordinator) does not hold up the requests: they have
    their EngineDied while it is still under way."""

    async def scenario() -> None:
        reporting, release = asyncio.Event(), asyncio.Event()

        async def slow_report() -> None:
            reporting.set()
            await release.wait()

        feed, engine = scripted_feed(on_death=slow_report)
        queue = await feed.open("a")
        engine.script.put_nowait(ConnectionResetError())
        await reporting.wait()
        with pytest.raises(EngineDied, match="decode-0"):
            await anext(feed.events("a", queue))
        release.set()
        await ended(feed)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_feed_the_replica_closes_reports_nothing():
    async def scenario() -> None:
        feed, engine = scripted_feed()
        await feed.open("a")
        feed.reading.cancel()
        await ended(feed)
        assert feed.dead
        assert engine.deaths_reported == 0

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_broken_feed_from_a_live_engine_fails_its_requests_not_the_engine():
    """The connection breaks but the engine answers over Ray: its requests end with FeedLost
    (not EngineDied, which would have the engine restarted), and the feed is not reused."""

    async def scenario() -> None:
        feed, engine = scripted_feed(alive=True)
        queue = await feed.open("a")
        engine.script.put_nowait(ConnectionResetError())
        with pytest.raises(FeedLost, match="decode-0"):
            await anext(feed.events("a", queue))
        assert feed.dead and feed.lost is not None
        with pytest.raises(FeedLost):
            await feed.open("b")
        await ended(feed)
        assert engine.deaths_reported == 0

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_events_waiting_together_come_out_joined_in_order():
    """A reader that falls behind gets what has queued up as few events as the tokens allow:
    continuing events joined, anything else (another choice, a repeat) after them, in order."""

    async def scenario() -> None:
        feed, engine = scripted_feed()
        queue = await feed.open("a")
        engine.script.put_nowait(
            TokenBatch(
                [
                    TokenEvent("a", 0, [1], index=0),
                    TokenEvent("a", 1, [2], index=0),
                    TokenEvent("a", 0, [5], index=1),  # the other choice
                    TokenEvent("a", 1, [6], index=1),
                    TokenEvent("a", 2, [3], finish_reason="length", index=0),
                    TokenEvent("a", 2, [7], finish_reason="length", index=1, last=True),
                ]
            )
        )
        events = [e async for e in feed.events("a", queue)]
        assert [(e.index, e.offset, e.token_ids, e.finish_reason) for e in events] == [
            (0, 0, [1, 2], None),
            (1, 0, [5, 6], None),
            (0, 2, [3], "length"),
            (1, 2, [7], "length"),
        ]
        assert events[-1].last

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_queued_events_still_come_out_before_the_engine_s_death():
    async def scenario() -> None:
        feed, engine = scripted_feed()
        queue = await feed.open("a")
        engine.script.put_nowait(TokenBatch([TokenEvent("a", 0, [1]), TokenEvent("a", 1, [2])]))
        engine.script.put_nowait(ConnectionResetError())
        while not feed.dead:
            await asyncio.sleep(0.01)
        events = feed.events("a", queue)
        assert (await anext(events)).token_ids == [1, 2]
        with pytest.raises(EngineDied, match="decode-0"):
            await anext(events)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_calls_get_their_own_replies_and_an_error_names_the_engine():
    async def scenario() -> None:
        feed, engine = scripted_feed()
        first = asyncio.ensure_future(feed.call("expect", "a", 1))
        second = asyncio.ensure_future(feed.call("release", "b"))
        calls = [await engine.calls.get(), await engine.calls.get()]
        assert [(c.method, c.args) for c in calls] == [("expect", ["a", 1]), ("release", ["b"])]
        # Answered out of order, in one batch.
        engine.script.put_nowait(
            TokenBatch(
                [],
                [
                    FeedReply(calls[1].call_id, error="ValueError: 'b' is not expected"),
                    FeedReply(calls[0].call_id, ["10.0.0.7", 5000]),
                ],
            )
        )
        assert await first == ["10.0.0.7", 5000]
        with pytest.raises(EngineCallFailed, match="engine decode-0: ValueError: 'b' is not"):
            await second
        feed.send("abort", "a")  # not waited for: call 0
        assert (await engine.calls.get()).call_id == 0

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_call_waiting_when_the_engine_dies_raises_engine_died():
    async def scenario() -> None:
        feed, engine = scripted_feed()
        waiting = asyncio.ensure_future(feed.call("prefill", {}, ["127.0.0.1", 1]))
        await engine.calls.get()
        engine.script.put_nowait(ConnectionResetError())
        with pytest.raises(EngineDied, match="decode-0"):
            await waiting
        with pytest.raises(EngineDied, match="decode-0"):
            await feed.call("expect", "b", 1)

    asyncio.run(asyncio.wait_for(scenario(), 10))
