"""Token events by subscription (cluster/token_feed.py). Engine side: a real EngineWorker
(tiny model) feeding a TokenOutbox; oracle: an offline engine, and one batch per step
carrying several requests' events. Both ends over loopback TCP: a real FeedServer and
EngineFeed. Ingress side alone: EngineFeed against a scripted server (the code under test is
the demultiplexing and the engine's death)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import RayActorError

from hybridserve.cluster.messages import FeedHello, FeedTicket, TokenBatch, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied
from hybridserve.cluster.token_feed import (
    HELLO_MAX_BYTES,
    TICKET_TTL_S,
    EngineFeed,
    FeedLost,
    FeedServer,
    TokenOutbox,
    frame,
    read_frame,
)
from tests.cluster.test_worker import (
    PROMPT,
    assert_idle_at_baseline,
    offline,
    request,
    tokens_of,
    worker,
)

OTHER_PROMPT = [(7 * i + 3) % 250 for i in range(40)]


async def until_finished(
    batches: AsyncIterator[TokenBatch], request_ids: set[str]
) -> tuple[dict[str, list[TokenEvent]], list[set[str]]]:
    """Every event of `request_ids` (by request), and the requests each batch carried."""
    events: dict[str, list[TokenEvent]] = {r: [] for r in request_ids}
    carried: list[set[str]] = []
    while request_ids:
        batch = await asyncio.wait_for(anext(batches), 30)
        carried.append({event.request_id for event in batch.events})
        for event in batch.events:
            events[event.request_id].append(event)
            if event.finished:
                request_ids.discard(event.request_id)
    return events, carried


@pytest.fixture(scope="module")
def colocated():
    w = worker("colocated", name="feed-colocated")
    yield w
    w.shutdown()


def test_one_batch_per_step_carries_every_request_s_tokens(colocated):
    requests = [request(), request(prompt=OTHER_PROMPT, max_tokens=12)]

    async def scenario() -> tuple[dict[str, list[TokenEvent]], list[set[str]], TokenOutbox]:
        outbox = TokenOutbox(colocated)
        batches = outbox.batches()
        assert (await anext(batches)).events == []  # the subscription is open
        for r in requests:
            outbox.submit(r)
        events, carried = await until_finished(batches, {r.request_id for r in requests})
        return events, carried, outbox

    events, carried, outbox = asyncio.run(scenario())
    assert tokens_of(events[requests[0].request_id]) == offline()
    assert tokens_of(events[requests[1].request_id]) == offline(OTHER_PROMPT, max_tokens=12)
    # Decode steps run both requests: their events travel together, in fewer batches than
    # events (a batch holds every event since the subscriber's last one).
    assert any(len(ids) == 2 for ids in carried)
    assert len(carried) < sum(len(e) for e in events.values())
    assert outbox.request_ids == set() and colocated._streams == {}
    assert_idle_at_baseline(colocated)


def test_closing_the_outbox_aborts_what_its_subscriber_left_running(colocated):
    async def scenario() -> TokenOutbox:
        outbox = TokenOutbox(colocated)
        batches = outbox.batches()
        await anext(batches)
        outbox.submit(request(max_tokens=400))
        while not (await asyncio.wait_for(anext(batches), 30)).events:
            pass
        outbox.close()
        return outbox

    outbox = asyncio.run(scenario())
    assert outbox.request_ids == set() and colocated._streams == {}
    assert_idle_at_baseline(colocated)


def test_a_refused_request_raises_and_leaves_nothing_open(colocated):
    async def scenario() -> TokenOutbox:
        outbox = TokenOutbox(colocated)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            outbox.submit(request(prompt=[*PROMPT, 10_000]))
        return outbox

    outbox = asyncio.run(scenario())
    assert outbox.request_ids == set() and colocated._streams == {}
    assert_idle_at_baseline(colocated)


@pytest.fixture(scope="module")
def pair():
    prefill, decode = worker("prefill", name="feed-prefill"), worker("decode", name="feed-decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_attach_streams_an_expected_request_including_what_arrived_before(pair):
    """Prefill -> decode, the decode side attached only after the hand-over: the tokens it
    produced meanwhile come first, each exactly once (tokens_of checks the offsets)."""
    prefill, decode = pair

    async def scenario() -> list[TokenEvent]:
        outbox = TokenOutbox(decode)
        batches = outbox.batches()
        await anext(batches)
        req = request()
        address = await decode.expect(req.request_id)
        first, result = [m async for m in prefill.prefill(req, address)]
        assert isinstance(first, TokenEvent) and result.status == "handed_off"
        await asyncio.sleep(0.2)  # let decode run ahead of the attach
        outbox.attach(req.request_id)
        events, _ = await until_finished(batches, {req.request_id})
        return [first, *events[req.request_id]]

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_prefill_s_first_token_goes_to_its_subscriber_and_its_result_is_returned(pair):
    """The prefill engine's outbox carries the first token; the decode engine continues from
    the transferred state (oracle: offline)."""
    prefill, decode = pair

    async def scenario() -> list[TokenEvent]:
        outbox = TokenOutbox(prefill)
        batches = outbox.batches()
        await anext(batches)
        req = request()
        address = await decode.expect(req.request_id)
        result = await outbox.prefill(req, address)
        assert result.status == "handed_off" and result.blocks_sent > 0
        (first,) = (await asyncio.wait_for(anext(batches), 30)).events
        assert outbox.request_ids == set()
        return [first, *[e async for e in decode.follow(req.request_id)]]

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_prefill_the_engine_refuses_returns_the_error_and_leaves_nothing_open(pair):
    prefill, decode = pair

    async def scenario() -> None:
        outbox = TokenOutbox(prefill)
        req = request(prompt=[*PROMPT, 10_000])
        address = await decode.expect(req.request_id)
        result = await outbox.prefill(req, address)
        assert result.status == "error" and "outside the vocabulary" in result.detail
        assert outbox.request_ids == set()
        await decode.release(req.request_id)

    asyncio.run(scenario())
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_cancelled_prefill_drops_the_request_on_the_engine(pair):
    """The ingress cancels the call (its client went away) while the prompt is computed:
    nothing stays on the prefill engine, and what reached the decode engine goes with the
    release."""
    prefill, decode = pair

    async def scenario() -> None:
        outbox = TokenOutbox(prefill)
        req = request(max_tokens=400)
        address = await decode.expect(req.request_id)
        call = asyncio.ensure_future(outbox.prefill(req, address))
        await asyncio.sleep(0)  # submitted: the prompt is being computed
        assert outbox.request_ids == {req.request_id}
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert outbox.request_ids == set() and prefill._streams == {}
        await decode.release(req.request_id)

    asyncio.run(scenario())
    deadline = time.monotonic() + 30  # a transfer cut off mid-way settles on its own
    while any(w.check_integrity()["busy"] for w in pair) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


class ScriptedEngine:
    """Stands in for an engine actor handle: `subscribe` hands out a ticket for a TCP server
    of its own, which checks the hello and writes the batches put on `script` as frames
    (an exception closes the connection: the engine died)."""

    def __init__(self, alive: bool = False) -> None:
        self.script: asyncio.Queue[TokenBatch | BaseException] = asyncio.Queue()
        self.subscribe = self
        self.describe = Describe(alive)
        self.subscribers: list[str] = []
        self.hellos: list[FeedHello] = []

    async def remote(self, subscriber: str) -> dict[str, Any]:
        self.subscribers.append(subscriber)
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return FeedTicket("127.0.0.1", server.sockets[0].getsockname()[1], "t-1").to_dict()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hellos.append(FeedHello.from_dict(await read_frame(reader)))
        while not isinstance(item := await self.script.get(), BaseException):
            writer.write(frame(item.to_dict()))
            await writer.drain()
        writer.close()


class Describe:
    """`describe`, as the feed asks it after its connection broke: the engine answers (it
    lives), or the call fails as Ray's does for a dead actor."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    async def remote(self) -> dict[str, Any]:
        if not self.alive:
            raise RayActorError()
        return {}


class FeedServerHandle:
    """Stands in for an engine actor handle over a real FeedServer: `subscribe` asks it for
    a ticket, as the actor's method does."""

    def __init__(self, server: FeedServer) -> None:
        self.server = server
        self.subscribe = self

    async def remote(self, subscriber: str) -> dict[str, Any]:
        return (await self.server.admit(subscriber)).to_dict()


def test_a_replica_reads_an_engine_s_batches_over_its_connection(colocated):
    """Engine and replica ends together over loopback TCP: the replica's requests stream
    their tokens (oracle: offline), and when the replica goes, what it left running is
    aborted."""
    requests = [request(), request(prompt=OTHER_PROMPT, max_tokens=400)]

    async def scenario() -> list[int]:
        server = FeedServer(colocated, "127.0.0.1")
        feed = EngineFeed("colocated", FeedServerHandle(server))
        queues = [await feed.open(r.request_id) for r in requests]
        for r in requests:
            server.outbox(feed.subscriber).submit(r)
        tokens = tokens_of([e async for e in feed.events(requests[0].request_id, queues[0])])
        # The replica goes away (its connection closes) while the long request still runs.
        feed.close(requests[1].request_id)
        feed.reading.cancel()
        while server.outboxes:
            await asyncio.sleep(0.01)
        server.close()
        return tokens

    tokens = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert tokens == offline()
    assert colocated._streams == {}
    assert_idle_at_baseline(colocated)


def test_a_connection_without_a_valid_ticket_gets_nothing(colocated):
    async def scenario() -> list[bytes]:
        server = FeedServer(colocated, "127.0.0.1")
        ticket = await server.admit("replica-1")
        received = []
        expired = await server.admit("replica-2")
        subscriber, issued = server._tickets[expired.ticket]
        server._tickets[expired.ticket] = (subscriber, issued - TICKET_TTL_S)
        oversize = FeedHello("x" * HELLO_MAX_BYTES)  # refused before it is read
        hellos = [FeedHello("forged"), oversize, FeedHello(expired.ticket)]
        for hello in (*hellos, FeedHello(ticket.ticket), FeedHello(ticket.ticket)):
            reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
            writer.write(frame(hello.to_dict()))
            received.append(await reader.read(1))  # b"": closed without a frame
            writer.close()
            while server.outboxes:
                await asyncio.sleep(0.01)
        server.close()
        return received

    # Forged, oversize, expired and reused tickets are refused; the real one gets the first
    # batch.
    forged, oversize, expired, real, reused = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (forged, oversize, expired, len(real), reused) == (b"", b"", b"", 1, b"")
    assert_idle_at_baseline(colocated)


def test_the_feed_hands_each_event_to_its_request_and_reports_the_engine_s_death():
    async def scenario() -> None:
        engine = ScriptedEngine()
        feed = EngineFeed("decode-0", engine)
        engine.script.put_nowait(TokenBatch([]))
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

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_broken_feed_from_a_live_engine_fails_its_requests_not_the_engine():
    """The connection breaks but the engine answers over Ray: its requests end with FeedLost
    (not EngineDied, which would have the engine restarted), and the feed is not reused."""

    async def scenario() -> None:
        engine = ScriptedEngine(alive=True)
        feed = EngineFeed("decode-0", engine)
        engine.script.put_nowait(TokenBatch([]))
        queue = await feed.open("a")
        engine.script.put_nowait(ConnectionResetError())
        with pytest.raises(FeedLost, match="decode-0"):
            await anext(feed.events("a", queue))
        assert feed.dead and feed.lost is not None
        with pytest.raises(FeedLost):
            await feed.open("b")

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_events_waiting_together_come_out_joined_in_order():
    """A reader that falls behind gets what has queued up as few events as the tokens allow:
    continuing events joined, anything else (another choice, a repeat) after them, in order."""

    async def scenario() -> None:
        engine = ScriptedEngine()
        feed = EngineFeed("decode-0", engine)
        engine.script.put_nowait(TokenBatch([]))
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
        engine = ScriptedEngine()
        feed = EngineFeed("decode-0", engine)
        engine.script.put_nowait(TokenBatch([]))
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
