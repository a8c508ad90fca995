"""Token events from an engine actor to an ingress replica: one TCP connection per (replica,
engine), one message per engine step.

A Ray streaming call per request puts every token of every request through its own Ray
object, report and await: 32 streams cost 32 of them per engine step, in the engine actor,
in Ray and in the ingress, on the cores the engine steps on. Even one Ray stream per replica
costs ~0.55 ms of CPU in the engine actor and ~0.75 ms in the ingress per item on the 2-core
benchmark machine (a bare async actor streaming small dicts), against a decode step of
~2.7 ms. So each ingress replica opens one connection to each engine it uses, with a ticket
it asks the engine actor for over Ray (only the cluster's processes get one), and the engine
writes, per step, one `TokenBatch` frame with the events of every request of that replica:

    ingress replica                                    engine actor
    EngineFeed ── subscribe(subscriber) (Ray) ────────▶ FeedServer.admit: FeedTicket
       ── TCP connect, FeedHello(ticket) ─────────────▶ FeedServer: a TokenOutbox for it
       ◀─────────── TokenBatch frame per step ──────────
    RayEngine.generate ── generate(request, subscriber) ▶ worker.submit(request, outbox.push)
    RayEngine.follow   ── follow(request_id, subscriber) ▶ worker.attach(request_id, outbox.push)
    RayEngine.prefill  ── prefill(request, address, subscriber) ▶ worker.submit_prefill(...):
                          the first token on the feed, the PrefillResult as the call's reply

    frame := 4-byte big-endian length | msgpack of the message's dict (cluster/messages.py)

The feed hands each event to the queue of its request; a request that its caller gave up
is aborted explicitly (the orchestrator), as before. If the engine actor dies, its
connection closes and every request still open on the feed ends with EngineDied. If the
replica goes away, its connection closes on the engine side and every request it left open
there is aborted.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import secrets
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgpack
from ray.exceptions import RayActorError

from hybridserve.cluster.messages import (
    FeedHello,
    FeedTicket,
    GenerateRequest,
    PrefillResult,
    TokenBatch,
    TokenEvent,
)
from hybridserve.cluster.orchestrator import EngineDied

if TYPE_CHECKING:
    from hybridserve.cluster.worker import EngineWorker

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
# A batch with prompt logprobs of a long prompt is the largest frame: tens of MB at most.
MAX_FRAME_BYTES = 256 << 20
HELLO_MAX_BYTES = 1024  # what a connection may send before its ticket is checked
MAX_UNGREETED = 64  # connections at once that have not shown a ticket yet
HELLO_TIMEOUT_S = 10.0  # a connection that does not say which ticket it holds is dropped
CONNECT_TIMEOUT_S = 10.0
TICKET_TTL_S = 60.0  # a ticket nobody came back with (its replica went away) is forgotten
LIVENESS_TIMEOUT_S = 10.0  # asking an engine over Ray whether it lives, after its feed broke
# A peer that vanishes without closing (its node went) is noticed within ~25 s.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


class FeedLost(ConnectionError):
    """The token feed from an engine broke while the engine itself still answers over Ray:
    its requests on that feed end with this error (the engine aborts them), and the engine
    keeps serving."""


def frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a token feed frame of {len(payload)} bytes (at most {MAX_FRAME_BYTES})")
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    """The next frame's message; EOFError (asyncio.IncompleteReadError) when the peer closed,
    ValueError for a frame over `max_bytes` or not msgpack."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > max_bytes:
        raise ValueError(f"a token feed frame of {length} bytes (at most {max_bytes})")
    return msgpack.unpackb(await reader.readexactly(length))


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Probe an idle connection, so that a peer whose node vanished is noticed in seconds
    rather than after the system's default of hours."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE.items():
        if hasattr(socket, option):  # Linux names; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class TokenOutbox:
    """Engine side: the events of one subscriber's requests, batched until its stream takes
    them. Lives on the engine actor's event loop."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.request_ids: set[str] = set()  # open here for this subscriber
        self._events: list[TokenEvent] = []
        self._ready = asyncio.Event()

    def submit(self, request: GenerateRequest) -> None:
        self.request_ids.add(request.request_id)
        try:
            self.worker.submit(request, self._push)
        except BaseException:
            self.request_ids.discard(request.request_id)
            raise

    def attach(self, request_id: str) -> None:
        self.request_ids.add(request_id)
        try:
            self.worker.attach(request_id, self._push)
        except BaseException:
            self.request_ids.discard(request_id)
            raise

    async def prefill(
        self, request: GenerateRequest, decode_address: tuple[str, int]
    ) -> PrefillResult:
        """Prefill `request` here, its first token's event to this subscriber, and ship it
        to `decode_address`: how the transfer went (or why the request was refused). A
        cancelled call drops the request here."""
        request_id = request.request_id
        try:
            done = self.worker.submit_prefill(request, decode_address, self._push)
        except ValueError as exc:
            return PrefillResult(request_id, "error", detail=str(exc))
        self.request_ids.add(request_id)
        try:
            return await done
        finally:
            self.request_ids.discard(request_id)
            self.worker.close_stream(request_id)

    def _push(self, event: TokenEvent) -> None:
        self._events.append(event)
        self._ready.set()
        if event.finished and event.request_id in self.request_ids:
            self.request_ids.discard(event.request_id)
            self.worker.close_stream(event.request_id)

    async def batches(self) -> AsyncIterator[TokenBatch]:
        """An empty batch first (the subscription is open), then one per wake-up."""
        yield TokenBatch([])
        while True:
            await self._ready.wait()
            self._ready.clear()
            events, self._events = self._events, []
            yield TokenBatch(events)

    def close(self) -> None:
        """The subscriber is gone: nothing it left running may stay behind."""
        for request_id in list(self.request_ids):
            self.worker.close_stream(request_id)
        self.request_ids.clear()


class FeedServer:
    """Engine side: where ingress replicas read this engine's token batches, one connection
    and one TokenOutbox per replica. Lives on the engine actor's event loop; listens once the
    first replica asks (`admit`)."""

    def __init__(self, worker: EngineWorker, host: str) -> None:
        self.worker = worker
        self.host = host
        self.outboxes: dict[str, TokenOutbox] = {}  # by subscriber, while connected
        self._tickets: dict[str, tuple[str, float]] = {}  # ticket -> (subscriber, issued at)
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()  # replicas that subscribe at once start one listener
        self._writers: set[asyncio.StreamWriter] = set()
        self._num_ungreeted = 0

    async def admit(self, subscriber: str) -> FeedTicket:
        """A one-time ticket for `subscriber`'s connection (asked for over Ray)."""
        if subscriber in self.outboxes:
            raise ValueError(f"{subscriber!r} is already subscribed to {self.worker.name}")
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
        now = time.monotonic()
        self._tickets = {t: v for t, v in self._tickets.items() if now - v[1] < TICKET_TTL_S}
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = (subscriber, now)
        port = self._server.sockets[0].getsockname()[1]
        return FeedTicket(self.host, port, ticket)

    def outbox(self, subscriber: str) -> TokenOutbox:
        outbox = self.outboxes.get(subscriber)
        if outbox is None:
            raise ValueError(f"{subscriber!r} is not subscribed to {self.worker.name}")
        return outbox

    def close(self) -> None:
        """Stop listening and drop every connection (their requests are aborted)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self._num_ungreeted >= MAX_UNGREETED:
                logger.warning(
                    "engine %s: token feed connection refused: %d others wait to show a ticket",
                    self.worker.name,
                    self._num_ungreeted,
                )
                return
            self._num_ungreeted += 1
            try:
                subscriber = await self._greeted(reader)
            finally:
                self._num_ungreeted -= 1
            if subscriber is None:
                return
            keep_alive(writer)
            outbox = self.outboxes[subscriber] = TokenOutbox(self.worker)
            sending = asyncio.ensure_future(self._send(outbox, writer))
            # The replica sends nothing after its hello: the read ends when it goes away.
            gone = asyncio.ensure_future(reader.read(1))
            try:
                await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sending.cancel()
                gone.cancel()
                del self.outboxes[subscriber]
                outbox.close()
            if gone.done() and not gone.cancelled():
                gone.exception()  # a reset connection: the replica went, as with a close
            failure = sending.exception() if sending.done() and not sending.cancelled() else None
            if failure is not None and not isinstance(failure, OSError):
                logger.error(
                    "engine %s: token feed to %s failed",
                    self.worker.name,
                    subscriber,
                    exc_info=failure,
                )
            else:
                logger.info("engine %s: token feed to %s closed", self.worker.name, subscriber)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _greeted(self, reader: asyncio.StreamReader) -> str | None:
        """The subscriber whose ticket the connection's hello holds; None (logged) for a
        connection without a valid, unused ticket."""
        try:
            hello = await asyncio.wait_for(read_frame(reader, HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            entry = self._tickets.pop(FeedHello.from_dict(hello).ticket, None)
        except (OSError, EOFError, ValueError, TypeError) as exc:
            logger.warning("engine %s: token feed connection refused: %r", self.worker.name, exc)
            return None
        expired = entry is not None and time.monotonic() - entry[1] >= TICKET_TTL_S
        if entry is None or expired or entry[0] in self.outboxes:
            logger.warning(
                "engine %s: token feed connection refused: unknown, expired or used ticket",
                self.worker.name,
            )
            return None
        return entry[0]

    @staticmethod
    async def _send(outbox: TokenOutbox, writer: asyncio.StreamWriter) -> None:
        async for batch in outbox.batches():
            writer.write(frame(batch.to_dict()))
            await writer.drain()


class EngineFeed:
    """Ingress side: this replica's subscription to one engine actor, opened on first use,
    and the queue of each request that waits for events from it."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle
        self.subscriber = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue[TokenEvent | None]] = {}
        self._opened: asyncio.Future[None] | None = None
        # Reads the connection once opened; held here, as a task nobody holds may be collected
        # while it waits on the socket.
        self.reading: asyncio.Task[None] | None = None
        self.dead = False
        # Set once the feed ended with the engine still answering over Ray (FeedLost).
        self.lost: str | None = None

    async def open(self, request_id: str) -> asyncio.Queue[TokenEvent | None]:
        """A queue for `request_id`'s events, registered before the engine is asked to run
        or stream the request, so none is missed. Raises EngineDied if the engine is gone,
        FeedLost if only this feed broke."""
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
            # Outside the current request's Ray task: when a client goes away, Serve cancels
            # that task and Ray every actor call it made, which would end the subscription
            # of every other request too.
            self.reading = asyncio.get_running_loop().create_task(
                self._read(), context=contextvars.Context()
            )
        await asyncio.shield(self._opened)
        if self.dead:
            raise self.failure()
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        """Later events of `request_id` are dropped."""
        self._queues.pop(request_id, None)

    async def events(
        self, request_id: str, queue: asyncio.Queue[TokenEvent | None]
    ) -> AsyncIterator[TokenEvent]:
        """The request's events up to its final one; EngineDied if the engine goes first
        (FeedLost if only the feed broke).
        Events that wait in the queue together come out joined into one (`TokenEvent.joined`):
        a caller that falls behind the engine (many streams on few cores) then handles, and
        sends on, fewer and larger pieces instead of falling further behind."""
        try:
            waiting: list[TokenEvent | None] = []
            while True:
                event = waiting.pop() if waiting else await queue.get()
                while event is not None and not queue.empty():
                    following = queue.get_nowait()
                    joined = None if following is None else event.joined(following)
                    if joined is None:
                        waiting.append(following)
                        break
                    event = joined
                if event is None:
                    raise self.failure()
                yield event
                if event.finished:
                    return
        finally:
            self.close(request_id)

    def failure(self) -> Exception:
        """What ends the requests on this feed: EngineDied if the engine is gone (the
        orchestrator reports it and the engine is restarted), else FeedLost (only these
        requests fail; the engine keeps serving)."""
        if self.lost is None:
            return EngineDied(self.name)
        return FeedLost(f"the token feed from engine {self.name} was lost: {self.lost}")

    async def _read(self) -> None:
        assert self._opened is not None
        writer: asyncio.StreamWriter | None = None
        try:
            ticket = FeedTicket.from_dict(await self.handle.subscribe.remote(self.subscriber))
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ticket.host, ticket.port), CONNECT_TIMEOUT_S
            )
            keep_alive(writer)
            writer.write(frame(FeedHello(ticket.ticket).to_dict()))
            while True:
                batch = TokenBatch.from_dict(await read_frame(reader))
                if not self._opened.done():
                    self._opened.set_result(None)
                for event in batch.events:
                    queue = self._queues.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
        except RayActorError:
            pass  # the engine is gone: EngineDied to every open request
        except Exception as exc:  # the connection, not necessarily the engine
            if await self._engine_alive():
                self.lost = repr(exc)
            logger.warning("engine %s: token feed to this replica failed: %r", self.name, exc)
        finally:
            if writer is not None:
                writer.close()
            self.dead = True
            logger.warning("engine %s: token feed to this replica ended", self.name)
            if not self._opened.done():
                self._opened.set_result(None)
            for queue in self._queues.values():
                queue.put_nowait(None)

    async def _engine_alive(self) -> bool:
        """Whether the engine actor still answers over Ray. One that is alive but does not
        answer in time counts as alive: the Coordinator's health checks judge wedged ones."""
        try:
            await asyncio.wait_for(self.handle.describe.remote(), LIVENESS_TIMEOUT_S)
        except RayActorError:
            return False
        except Exception:
            return True
        return True
