"""The engine end of the token feeds (cluster/transport/feed_server.py): a real EngineHost (tiny
model) behind a TokenOutbox, which runs a replica's calls and batches its requests' events
and the calls' replies; oracle: an offline engine, one batch per step carrying several
requests' events, and the pools back at baseline. The FeedServer's ticket check over
loopback TCP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hybridserve.cluster.engine_host.host import EngineHost
from hybridserve.cluster.messages import FeedCall, FeedHello, FeedReply, TokenBatch, TokenEvent
from hybridserve.cluster.transport.feed_server import FeedServer, TokenOutbox
from hybridserve.cluster.transport.token_feed import (
    HELLO_MAX_BYTES,
    TICKET_TTL_S,
    frame,
    read_frame,
)
from tests.cluster.engine_host.test_host import (
    PROMPT,
    assert_idle_at_baseline,
    assert_settled_at_baseline,
    offline,
    request,
    tokens_of,
)

OTHER_PROMPT = [(7 * i + 3) % 250 for i in range(40)]


def feed_server(host: EngineHost) -> FeedServer:
    """An engine actor's feed server, over loopback."""
    return FeedServer(f"engine {host.name}", "127.0.0.1", lambda: TokenOutbox(host))


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


def test_one_batch_per_step_carries_every_request_s_tokens(colocated_host):
    requests = [request(), request(prompt=OTHER_PROMPT, max_tokens=12)]

    async def scenario() -> tuple[dict[str, list[TokenEvent]], list[set[str]], TokenOutbox]:
        outbox = TokenOutbox(colocated_host)
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
    assert outbox.request_ids == set() and colocated_host._streams == {}
    assert_idle_at_baseline(colocated_host)


def test_closing_the_outbox_aborts_what_its_subscriber_left_running(colocated_host):
    async def scenario() -> TokenOutbox:
        outbox = TokenOutbox(colocated_host)
        batches = outbox.batches()
        await anext(batches)
        outbox.submit(request(max_tokens=400))
        while not (await asyncio.wait_for(anext(batches), 30)).events:
            pass
        outbox.close()
        return outbox

    outbox = asyncio.run(scenario())
    assert outbox.request_ids == set() and colocated_host._streams == {}
    assert_idle_at_baseline(colocated_host)


def test_a_refused_request_raises_and_leaves_nothing_open(colocated_host):
    async def scenario() -> TokenOutbox:
        outbox = TokenOutbox(colocated_host)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            outbox.submit(request(prompt=[*PROMPT, 10_000]))
        return outbox

    outbox = asyncio.run(scenario())
    assert outbox.request_ids == set() and colocated_host._streams == {}
    assert_idle_at_baseline(colocated_host)


def test_attach_streams_an_expected_request_including_what_arrived_before(pd_hosts):
    """Prefill -> decode, the decode side attached only after the hand-over: the tokens it
    produced meanwhile come first, each exactly once (tokens_of checks the offsets)."""
    prefill, decode = pd_hosts

    async def scenario() -> list[TokenEvent]:
        outbox = TokenOutbox(decode)
        batches = outbox.batches()
        await anext(batches)
        req = request()
        await decode.expect(req.request_id)
        address = decode.address
        first, result = [m async for m in prefill.prefill(req, address)]
        assert isinstance(first, TokenEvent) and result.status == "handed_off"
        await asyncio.sleep(0.2)  # let decode run ahead of the attach
        outbox.attach(req.request_id)
        events, _ = await until_finished(batches, {req.request_id})
        return [first, *events[req.request_id]]

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_prefill_s_first_token_goes_to_its_subscriber_and_its_result_is_returned(pd_hosts):
    """The prefill engine's outbox carries the first token; the decode engine continues from
    the transferred state (oracle: offline)."""
    prefill, decode = pd_hosts

    async def scenario() -> list[TokenEvent]:
        outbox = TokenOutbox(prefill)
        batches = outbox.batches()
        await anext(batches)
        req = request()
        await decode.expect(req.request_id)
        address = decode.address
        result = await outbox.prefill(req, address)
        assert result.status == "handed_off" and result.blocks_sent > 0
        (first,) = (await asyncio.wait_for(anext(batches), 30)).events
        assert outbox.request_ids == set()
        return [first, *[e async for e in decode.follow(req.request_id)]]

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_prefill_the_engine_refuses_returns_the_error_and_leaves_nothing_open(pd_hosts):
    prefill, decode = pd_hosts

    async def scenario() -> None:
        outbox = TokenOutbox(prefill)
        req = request(prompt=[*PROMPT, 10_000])
        await decode.expect(req.request_id)
        address = decode.address
        result = await outbox.prefill(req, address)
        assert result.status == "error" and "outside the vocabulary" in result.detail
        assert outbox.request_ids == set()
        await decode.release(req.request_id)

    asyncio.run(scenario())
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_cancelled_prefill_drops_the_request_on_the_engine(pd_hosts):
    """The ingress cancels the call (its client went away) while the prompt is computed:
    nothing stays on the prefill engine, and what reached the decode engine goes with the
    release."""
    prefill, decode = pd_hosts

    async def scenario() -> None:
        outbox = TokenOutbox(prefill)
        req = request(max_tokens=400)
        await decode.expect(req.request_id)
        address = decode.address
        call = asyncio.ensure_future(outbox.prefill(req, address))
        await asyncio.sleep(0)  # submitted: the prompt is being computed
        assert outbox.request_ids == {req.request_id}
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert outbox.request_ids == set() and prefill._streams == {}
        await decode.release(req.request_id)

    asyncio.run(scenario())
    assert_settled_at_baseline(prefill, decode)


def test_a_connection_without_a_valid_ticket_gets_nothing(colocated_host):
    async def scenario() -> list[bytes]:
        server = feed_server(colocated_host)
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
            while server.sessions:
                await asyncio.sleep(0.01)
        server.close()
        return received

    # Forged, oversize, expired and reused tickets are refused; the real one gets the first
    # batch.
    forged, oversize, expired, real, reused = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (forged, oversize, expired, len(real), reused) == (b"", b"", b"", 1, b"")
    assert_idle_at_baseline(colocated_host)


async def answered(
    outbox: TokenOutbox, batches: AsyncIterator[TokenBatch], call: FeedCall
) -> tuple[FeedReply, list[TokenEvent]]:
    """Run `call` on `outbox`: its FeedReply, and the events that came up to it."""
    outbox.call(call)
    events: list[TokenEvent] = []
    while True:
        batch = await asyncio.wait_for(anext(batches), 30)
        events += batch.events
        if batch.replies:
            (reply,) = batch.replies
            assert reply.call_id == call.call_id
            return reply, events


def test_calls_run_on_the_engine_and_are_answered_by_id(pd_hosts):
    """expect, then a prefill (its first token an event, its result the reply), follow, and
    calls the engine refuses, each answered under its own call id."""
    prefill, decode = pd_hosts

    async def scenario() -> list[TokenEvent]:
        prefill_box, decode_box = TokenOutbox(prefill), TokenOutbox(decode)
        prefill_batches, decode_batches = prefill_box.batches(), decode_box.batches()
        await anext(prefill_batches), await anext(decode_batches)
        req = request()
        expect = FeedCall(1, "expect", [req.request_id, 1])
        expected, _ = await answered(decode_box, decode_batches, expect)
        assert expected.error is None and expected.value is None
        prefill_call = FeedCall(2, "prefill", [req.to_dict(), list(decode.address)])
        result, first = await answered(prefill_box, prefill_batches, prefill_call)
        assert result.value["status"] == "handed_off" and len(first) == 1
        follow = FeedCall(3, "follow", [req.request_id])
        followed, queued = await answered(decode_box, decode_batches, follow)
        assert followed.error is None
        rest: list[TokenEvent] = []
        if not any(event.finished for event in queued):  # the engine may be done already
            rest = (await until_finished(decode_batches, {req.request_id}))[0][req.request_id]
        unknown = FeedCall(4, "resume", [req.request_id])
        refused, _ = await answered(decode_box, decode_batches, unknown)
        assert refused.error == "ValueError: no feed call 'resume' with 1 arguments"
        stranger = FeedCall(5, "follow", ["nobody"])
        refused, _ = await answered(decode_box, decode_batches, stranger)
        assert refused.error is not None and "not expected" in refused.error
        return [*first, *queued, *rest]

    assert tokens_of(asyncio.run(scenario())) == offline()
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_subscriber_gone_mid_prefill_drops_the_request(pd_hosts):
    """Its connection closed while its prefill call waited for the transfer: the call is
    cancelled, and nothing stays on either engine once the decode stream is released."""
    prefill, decode = pd_hosts

    async def scenario() -> None:
        outbox = TokenOutbox(prefill)
        req = request(max_tokens=400)
        await decode.expect(req.request_id)
        address = decode.address
        outbox.call(FeedCall(1, "prefill", [req.to_dict(), list(address)]))
        await asyncio.sleep(0)  # submitted: the prompt is being computed
        assert outbox.request_ids == {req.request_id}
        outbox.close()
        await asyncio.sleep(0.01)  # the cancelled call's task ends
        assert outbox.request_ids == set() and prefill._streams == {}
        # The call was cancelled, not answered: nothing waits to go to a replica that left.
        assert outbox._calls == set() and outbox._replies == []
        await decode.release(req.request_id)

    asyncio.run(scenario())
    assert_settled_at_baseline(prefill, decode)


def test_a_prefill_ended_by_its_first_token_answers_finished(pd_hosts):
    """Nothing to ship: the reply says so, after the token's event, and the engine has let
    the request go."""
    prefill, decode = pd_hosts

    async def scenario() -> tuple[FeedReply, list[TokenEvent]]:
        outbox = TokenOutbox(prefill)
        batches = outbox.batches()
        await anext(batches)
        req = request(max_tokens=1)
        await decode.expect(req.request_id)
        call = FeedCall(1, "prefill", [req.to_dict(), list(decode.address)])
        answer = await answered(outbox, batches, call)
        await decode.release(req.request_id)
        return answer

    reply, events = asyncio.run(scenario())
    assert reply.value["status"] == "finished"
    assert tokens_of(events) == offline(max_tokens=1) and events[-1].finished
    assert decode._streams == {} and prefill._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_stream_expected_for_a_subscriber_goes_with_it(pd_hosts):
    """`expect`, then the replica leaves before it follows or releases the request."""
    prefill, decode = pd_hosts

    async def scenario() -> None:
        outbox = TokenOutbox(decode)
        batches = outbox.batches()
        await anext(batches)
        reply, _ = await answered(outbox, batches, FeedCall(1, "expect", ["r-left", 1]))
        assert reply.error is None and "r-left" in decode._streams
        outbox.close()

    asyncio.run(scenario())
    assert decode._streams == {}
    assert_idle_at_baseline(prefill, decode)


def test_a_malformed_call_is_answered_and_the_connection_goes_on(colocated_host):
    """Over loopback TCP: a call frame missing its arguments gets an error reply under its
    call id; the next call on the same connection is run."""

    async def scenario() -> list[FeedReply]:
        server = feed_server(colocated_host)
        ticket = await server.admit("replica-1")
        reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
        writer.write(frame(FeedHello(ticket.ticket).to_dict()))
        await read_frame(reader)  # the first, empty batch: the subscription is open
        malformed = FeedCall(7, "abort", ["r1"]).to_dict()
        del malformed["args"]
        writer.write(frame(malformed))
        writer.write(frame(FeedCall(8, "abort", ["r-unknown"]).to_dict()))
        replies: list[FeedReply] = []
        while len(replies) < 2:
            replies += TokenBatch.from_dict(await asyncio.wait_for(read_frame(reader), 10)).replies
        writer.close()
        while server.sessions:
            await asyncio.sleep(0.01)
        server.close()
        return replies

    malformed, aborted = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert malformed.call_id == 7 and "malformed" in malformed.error
    assert (aborted.call_id, aborted.value, aborted.error) == (8, False, None)
    assert_idle_at_baseline(colocated_host)
