"""The serving end of the token feeds (cluster/transport/token_feed.py has the protocol): a
`FeedServer` per actor that ingress replicas call on the request path (each engine, the
router), where they connect with a ticket, and a session per connected replica, which runs
its calls and batches what goes back: an engine's `TokenOutbox` (calls, and its requests'
token events), the router's `RouteSession` (cluster/control/actors.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from hybridserve.cluster.messages import (
    FeedCall,
    FeedHello,
    FeedReply,
    FeedTicket,
    GenerateRequest,
    MessageError,
    PrefillResult,
    TokenBatch,
    TokenEvent,
)
from hybridserve.cluster.transport.token_feed import (
    HELLO_MAX_BYTES,
    HELLO_TIMEOUT_S,
    MAX_UNGREETED,
    TICKET_TTL_S,
    frame,
    keep_alive,
    read_frame,
)

if TYPE_CHECKING:
    from hybridserve.cluster.engine_host.host import EngineHost

logger = logging.getLogger(__name__)


class FeedSession:
    """One subscriber's connection, on the serving actor's side: runs its calls (`_run`) and
    batches what goes back to it (replies, and the events of an engine's requests) until the
    connection takes them. Lives on the actor's event loop."""

    def __init__(self, name: str) -> None:
        self.name = name  # the serving actor's, for logs
        self._events: list[TokenEvent] = []
        self._replies: list[FeedReply] = []
        self._ready = asyncio.Event()
        self._calls: set[asyncio.Task[None]] = set()  # under way (a prefill waits its transfer)

    def call(self, call: FeedCall) -> None:
        """Run `call`; its FeedReply goes back in a later batch."""
        task = asyncio.ensure_future(self._answer(call))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _answer(self, call: FeedCall) -> None:
        try:
            reply = FeedReply(call.call_id, await self._run(call.method, call.args))
        except Exception as exc:  # the caller raises it
            if not isinstance(exc, (ValueError, RuntimeError)):
                logger.exception("%s: feed call %s failed", self.name, call.method)
            reply = FeedReply(call.call_id, error=f"{type(exc).__name__}: {exc}")
        self.answer(reply)

    def answer(self, reply: FeedReply) -> None:
        self._replies.append(reply)
        self._ready.set()

    async def _run(self, method: str, args: list[Any]) -> Any:
        """The value of `method(*args)`; ValueError for a call this session does not take."""
        raise ValueError(f"no feed call {method!r} with {len(args)} arguments")

    async def batches(self) -> AsyncIterator[TokenBatch]:
        """An empty batch first (the subscription is open), then one per wake-up."""
        yield TokenBatch([])
        while True:
            await self._ready.wait()
            self._ready.clear()
            events, self._events = self._events, []
            replies, self._replies = self._replies, []
            yield TokenBatch(events, replies)

    def close(self) -> None:
        """The subscriber is gone: its calls under way stop."""
        for task in list(self._calls):
            task.cancel()


class TokenOutbox(FeedSession):
    """An engine's session with one subscriber: the engine calls, and the events of the
    requests it runs or follows here."""

    def __init__(self, host: EngineHost) -> None:
        super().__init__(f"engine {host.name}")
        self.host = host
        self.request_ids: set[str] = set()  # open here for this subscriber

    async def _run(self, method: str, args: list[Any]) -> Any:
        match method, args:
            case "generate", [request]:
                self.submit(GenerateRequest.from_dict(request))
            case "prefill", [request, [host, port]]:
                address = (str(host), int(port))
                return (await self.prefill(GenerateRequest.from_dict(request), address)).to_dict()
            case "expect", [request_id, num_choices]:
                await self.host.expect(request_id, num_choices)
                self.request_ids.add(request_id)  # released or followed by this subscriber
            case "follow", [request_id]:
                self.attach(request_id)
            case "recover", [request, delivered, reason]:
                await self.host.recover(GenerateRequest.from_dict(request), delivered, reason)
            case "release", [request_id]:
                self.request_ids.discard(request_id)
                await self.host.release(request_id)
            case "abort", [request_id]:
                return await self.host.abort(request_id)
            case _:
                return await super()._run(method, args)
        return None

    def submit(self, request: GenerateRequest) -> None:
        self.request_ids.add(request.request_id)
        try:
            self.host.submit(request, self._push)
        except BaseException:
            self.request_ids.discard(request.request_id)
            raise

    def attach(self, request_id: str) -> None:
        self.request_ids.add(request_id)
        try:
            self.host.attach(request_id, self._push)
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
            done = self.host.submit_prefill(request, decode_address, self._push)
        except ValueError as exc:
            return PrefillResult(request_id, "error", detail=str(exc))
        self.request_ids.add(request_id)
        try:
            return await done
        finally:
            self.request_ids.discard(request_id)
            self.host.close_stream(request_id)

    def _push(self, event: TokenEvent) -> None:
        self._events.append(event)
        self._ready.set()
        if event.finished and event.request_id in self.request_ids:
            self.request_ids.discard(event.request_id)
            self.host.close_stream(event.request_id)

    def close(self) -> None:
        """The subscriber is gone: nothing it left running may stay behind."""
        super().close()  # a prefill's call drops its request
        for request_id in list(self.request_ids):
            self.host.close_stream(request_id)
        self.request_ids.clear()


class FeedServer:
    """Where ingress replicas connect to an actor (an engine, the router): one connection and
    one session (`new_session()`) per replica. Lives on the actor's event loop; listens once the
    first replica asks (`admit`)."""

    def __init__(self, name: str, host: str, new_session: Callable[[], FeedSession]) -> None:
        self.name = name  # the actor's, for logs and errors
        self.host = host
        self.new_session = new_session
        self.sessions: dict[str, FeedSession] = {}  # by subscriber, while connected
        self._tickets: dict[str, tuple[str, float]] = {}  # ticket -> (subscriber, issued at)
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()  # replicas that subscribe at once start one listener
        self._writers: set[asyncio.StreamWriter] = set()
        self._num_ungreeted = 0

    async def admit(self, subscriber: str) -> FeedTicket:
        """A one-time ticket for `subscriber`'s connection (asked for over Ray)."""
        if subscriber in self.sessions:
            raise ValueError(f"{subscriber!r} is already subscribed to {self.name}")
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
        now = time.monotonic()
        self._tickets = {t: v for t, v in self._tickets.items() if now - v[1] < TICKET_TTL_S}
        ticket = secrets.token_hex(16)
        self._tickets[ticket] = (subscriber, now)
        port = self._server.sockets[0].getsockname()[1]
        return FeedTicket(self.host, port, ticket)

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
                    "%s: token feed connection refused: %d others wait to show a ticket",
                    self.name,
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
            session = self.sessions[subscriber] = self.new_session()
            sending = asyncio.ensure_future(self._send(session, writer))
            # The replica's calls, until it goes away.
            receiving = asyncio.ensure_future(self._receive(session, reader))
            try:
                await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sending.cancel()
                receiving.cancel()
                del self.sessions[subscriber]
                session.close()
            failures = [
                task.exception()
                for task in (sending, receiving)
                if task.done() and not task.cancelled()
            ]
            # A closed or reset connection: the replica went.
            failures = [
                f for f in failures if f is not None and not isinstance(f, (OSError, EOFError))
            ]
            if failures:
                logger.error(
                    "%s: token feed to %s failed",
                    self.name,
                    subscriber,
                    exc_info=failures[0],
                )
            else:
                logger.info("%s: token feed to %s closed", self.name, subscriber)
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
            logger.warning("%s: token feed connection refused: %r", self.name, exc)
            return None
        expired = entry is not None and time.monotonic() - entry[1] >= TICKET_TTL_S
        if entry is None or expired or entry[0] in self.sessions:
            logger.warning(
                "%s: token feed connection refused: unknown, expired or used ticket",
                self.name,
            )
            return None
        return entry[0]

    @staticmethod
    async def _send(session: FeedSession, writer: asyncio.StreamWriter) -> None:
        async for batch in session.batches():
            writer.write(frame(batch.to_dict()))
            await writer.drain()

    async def _receive(self, session: FeedSession, reader: asyncio.StreamReader) -> None:
        while True:
            message = await read_frame(reader)
            try:
                call = FeedCall.from_dict(message)
            except MessageError as exc:  # answered, when it says which call it is
                call_id = message.get("call_id") if isinstance(message, dict) else None
                logger.warning("%s: a malformed feed call: %s", self.name, exc)
                session.answer(
                    FeedReply(call_id if isinstance(call_id, int) else 0, error=str(exc))
                )
                continue
            session.call(call)
