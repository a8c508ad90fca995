"""The orchestrator's clients in the service: `RemoteEngine` (an EngineActor) and
`RemoteRouter` (the RouterActor), each through this replica's feed connection to that actor
(cluster/transport/token_feed.py). Only plain dicts cross (cluster/messages.py). A call or stream
that fails because the actor is gone raises EngineDied with its name; FeedLost when only the
connection broke (the actor lives); EngineCallFailed when the actor answered a call with an
error.

Calls on a feed are not Ray tasks: when a request's coroutine is cancelled (its client went
away; Serve cancels the request's task), a call it already sent still runs, so its effect is
known: a route that lands after its caller left gives its load back, and the orchestrator
aborts the request explicitly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from hybridserve.cluster.messages import (
    GenerateRequest,
    PrefillResult,
    PromptChain,
    Route,
    RouteRefusal,
    TokenEvent,
)
from hybridserve.cluster.routing.prefix_index import prompt_chain
from hybridserve.cluster.routing.router import RouteRefused
from hybridserve.cluster.transport.token_feed import EngineFeed


class RemoteEngine:
    """An engine through `feed`, this replica's connection to it (one per engine, shared by
    every request that runs there)."""

    def __init__(self, name: str, feed: EngineFeed, address: tuple[str, int] | None = None) -> None:
        """`address`: where prefill engines send its transfers (a decode engine's)."""
        self.name = name
        self.feed = feed
        self.address = address

    async def _stream(self, request_id: str, method: str, *args: Any) -> AsyncIterator[TokenEvent]:
        """Ask the engine to send `request_id`'s events to this replica's feed, then yield
        them."""
        queue = await self.feed.open(request_id)
        try:
            await self.feed.call(method, *args)
        except BaseException:
            self.feed.close(request_id)
            raise
        async for event in self.feed.events(request_id, queue):
            yield event

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request.request_id, "generate", request.to_dict())

    async def expect(self, request_id: str, num_choices: int = 1) -> None:
        await self.feed.call("expect", request_id, num_choices)

    async def prefill(
        self, request: GenerateRequest, address: tuple[str, int]
    ) -> AsyncGenerator[TokenEvent | PrefillResult, None]:
        """One call for the request: the first token's event comes on the feed as soon as
        the engine has it (none if the engine refused the request), then the call's reply,
        the PrefillResult. Closing it early aborts the request on the engine."""
        request_id = request.request_id
        queue = await self.feed.open(request_id)
        reply = asyncio.ensure_future(self.feed.call("prefill", request.to_dict(), list(address)))
        first = asyncio.ensure_future(queue.get())
        ended = False  # the request ended here: the engine has let it go
        try:
            # The engine queues the token's event ahead of the reply, but a refused request
            # has no first token: whichever comes first.
            await asyncio.wait({first, reply}, return_when=asyncio.FIRST_COMPLETED)
            if first.done() or PrefillResult.from_dict(await reply).status != "error":
                event = await first
                if event is None:
                    raise self.feed.failure()
                ended = event.finished
                yield event
            yield PrefillResult.from_dict(await reply)
            ended = True
        finally:
            first.cancel()
            self.feed.close(request_id)
            if not reply.done():
                reply.cancel()
                if not ended:
                    self.feed.send("abort", request_id)
            elif not reply.cancelled():
                reply.exception()  # raised above, or superseded by what ended the request

    async def recover(self, request: GenerateRequest, delivered: int, reason: str) -> None:
        await self.feed.call("recover", request.to_dict(), delivered, reason)

    def follow(self, request_id: str) -> AsyncIterator[TokenEvent]:
        return self._stream(request_id, "follow", request_id)

    async def release(self, request_id: str) -> None:
        await self.feed.call("release", request_id)

    async def abort(self, request_id: str) -> None:
        # Not awaited: it runs while the request's caller is being torn down.
        self.feed.send("abort", request_id)


class RemoteRouter:
    """The router through `feed`, this replica's connection to it. The prompt's block chain
    is hashed here, in the ingress replica, so that routers only walk it."""

    def __init__(self, feed: EngineFeed, block_size: int) -> None:
        self.feed = feed
        self.block_size = block_size

    async def route(self, token_ids: list[int], cache_salt: str | None) -> Route:
        """Where the request runs; RouteRefused when no engine takes it now."""
        prompt = prompt_chain(token_ids, cache_salt, self.block_size)
        call = asyncio.ensure_future(self._route(prompt))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The route is counted against its engines' load when it lands: give it back.
            call.add_done_callback(self._release_unused)
            raise

    async def _route(self, prompt: PromptChain) -> Route:
        answer = await self.feed.call("route", prompt.to_dict())
        if isinstance(answer, dict) and answer.get("kind") == RouteRefusal.kind:
            refusal = RouteRefusal.from_dict(answer)
            raise RouteRefused(refusal.status, refusal.message)
        return Route.from_dict(answer)

    def _release_unused(self, call: asyncio.Future[Route]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        for engine in call.result().engines:
            self.feed.send("release", engine)

    async def release(self, engine: str) -> None:
        self.feed.send("release", engine)  # fire and forget
