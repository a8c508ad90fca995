"""Token feeds: one TCP connection per (ingress replica, engine actor) carries the replica's
calls to the engine and, per engine step, one message with the events of its requests and the
replies to its calls; the router actor serves the same kind of connection for routes. This
module has the protocol, the framing and the replica's end (`EngineFeed`);
cluster/transport/feed_server.py has the serving end.

A Ray streaming call per request puts every token of every request through its own Ray
object, report and await: 32 streams cost 32 of them per engine step, in the engine actor,
in Ray and in the ingress, on the cores the engine steps on. Even one Ray stream per replica
costs ~0.55 ms of CPU in the engine actor and ~0.75 ms in the ingress per item on the 2-core
benchmark machine (a bare async actor streaming small dicts), against a decode step of
~2.7 ms; and a Ray actor call takes ~1.5 ms there, where a frame each way on the socket takes
a few tenths of one. So each ingress replica opens one connection to each engine it uses,
with a ticket it asks the engine actor for over Ray (only the cluster's processes get one):

    ingress replica                                    engine actor
    EngineFeed ── subscribe(subscriber) (Ray) ────────▶ FeedServer.admit: FeedTicket
       ── TCP connect, FeedHello(ticket) ─────────────▶ FeedServer: a TokenOutbox for it
       ── FeedCall(call_id, method, args) ────────────▶ TokenOutbox runs it on the actor loop
       ◀── TokenBatch(events, replies) per step ────────
    calls: generate (events to this feed), prefill (its first token to this feed; the reply
    is the PrefillResult), expect, follow (events to this feed), recover, release, abort

    frame := 4-byte big-endian length | msgpack of the message's dict (cluster/messages.py)

The feed hands each event to the queue of its request and each reply to its call; a request
that its caller gave up is aborted explicitly (the orchestrator). If the engine actor dies,
its connection closes, every request and call still open on the feed ends with EngineDied,
and the feed reports the death (`on_death`), idle or not: a dead engine leaves routing when
the first replica connected to it notices, not at the Coordinator's next health check. If
the replica goes away, its connection closes on the engine side and every request it left
open there is aborted.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import socket
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgpack

from hybridserve.cluster.messages import FeedCall, FeedHello, FeedTicket, TokenBatch, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied, FeedLost

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
# A batch with prompt logprobs of a long prompt is the largest frame: tens of MB at most.
MAX_FRAME_BYTES = 256 << 20
HELLO_MAX_BYTES = 1024  # what a connection may send before its ticket is checked
MAX_UNGREETED = 64  # connections at once that have not shown a ticket yet
HELLO_TIMEOUT_S = 10.0  # a connection that does not say which ticket it holds is dropped
CONNECT_TIMEOUT_S = 10.0
TICKET_TTL_S = 60.0  # a ticket nobody came back with (its replica went away) is forgotten
# A peer that vanishes without closing (its node went) is noticed within ~25 s.
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


class ActorDied(ConnectionError):
    """The actor at the far end of a feed is dead (its control plane says so)."""


class FeedEndpoint(Protocol):
    """The actor at the far end of a feed, as the control plane reaches it: a Ray actor in
    the service (cluster/control/feed_endpoint.py)."""

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        """A FeedTicket (as a dict) for `subscriber`; ActorDied if the actor is dead."""

    async def alive(self) -> bool:
        """Whether the actor still lives. One that does not answer in time counts as alive:
        the Coordinator's health checks judge wedged ones."""


class EngineCallFailed(RuntimeError):
    """An engine answered a call with an error (a request it refused, an engine that is
    shutting down); the message names the engine and says why."""


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


class EngineFeed:
    """Ingress side: this replica's connection to one engine actor (or to the router, which
    sends no events), opened on first use: its calls, and the queue of each request that
    waits for events from it. `on_death` is awaited once if the feed ends because the actor
    is gone (not when only the connection broke, nor when the replica cancels its reader)."""

    def __init__(
        self,
        name: str,
        endpoint: FeedEndpoint,
        on_death: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.on_death = on_death
        self.subscriber = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue[TokenEvent | None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}  # by call id, until replied
        self._call_ids = itertools.count(1)
        self._opened: asyncio.Future[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
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
        await self.connect()
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def call(self, method: str, *args: Any) -> Any:
        """The engine's answer to `method(*args)` (cluster/transport/feed_server.py runs it). Raises
        EngineCallFailed if it answered with an error, EngineDied if the engine is gone,
        FeedLost if only this feed broke. A caller that stops waiting does not stop the call."""
        await self.connect()
        call_id = next(self._call_ids)
        reply = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(FeedCall(call_id, method, list(args)))
            return await reply
        finally:
            self._calls.pop(call_id, None)

    def send(self, method: str, *args: Any) -> None:
        """`method(*args)` without waiting for the answer (an abort on the way out). Nothing
        to do on a feed that is not open: the engine runs nothing for this replica then."""
        self._send(FeedCall(0, method, list(args)))  # call 0: its reply is dropped

    def _send(self, call: FeedCall) -> None:
        # No writer: the feed is ending, and a call waiting for its reply fails with it.
        if self._writer is not None:
            self._writer.write(frame(call.to_dict()))

    async def connect(self) -> None:
        """Open the connection now (else its first use opens it). Raises EngineDied if the
        actor is gone, FeedLost if only the connection failed."""
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
        gone = False  # the actor is dead (not just the connection)
        try:
            ticket = FeedTicket.from_dict(await self.endpoint.subscribe(self.subscriber))
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ticket.host, ticket.port), CONNECT_TIMEOUT_S
            )
            keep_alive(writer)
            writer.write(frame(FeedHello(ticket.ticket).to_dict()))
            while True:
                batch = TokenBatch.from_dict(await read_frame(reader))
                if not self._opened.done():
                    self._writer = writer
                    self._opened.set_result(None)
                for event in batch.events:
                    queue = self._queues.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
                for reply in batch.replies:
                    call = self._calls.get(reply.call_id)
                    if call is None or call.done():
                        continue  # a call sent without waiting, or given up
                    if reply.error is None:
                        call.set_result(reply.value)
                    else:
                        call.set_exception(EngineCallFailed(f"engine {self.name}: {reply.error}"))
        except Exception as exc:  # the engine's death, or only the connection's
            if writer is not None:
                writer.close()  # no call goes out while the engine is asked whether it lives
            self._writer = None
            gone = isinstance(exc, ActorDied) or not await self.endpoint.alive()
            if not gone:
                self.lost = repr(exc)  # FeedLost, not EngineDied, to every open request
            logger.warning("engine %s: token feed to this replica failed: %r", self.name, exc)
        finally:
            if writer is not None:
                writer.close()
            self.dead = True
            self._writer = None
            logger.warning("engine %s: token feed to this replica ended", self.name)
            if not self._opened.done():
                self._opened.set_result(None)
            for queue in self._queues.values():
                queue.put_nowait(None)
            for call in self._calls.values():
                if not call.done():
                    call.set_exception(self.failure())
        if gone and self.on_death is not None:
            try:
                await self.on_death()
            except Exception:  # the Coordinator's health checks find it later
                logger.exception("engine %s: reporting its death failed", self.name)
