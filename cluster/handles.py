"""The orchestrator's clients over Ray actor handles: `RayEngine` (an EngineActor) and
`RayRouter` (the RouterActor). Only plain dicts cross the actor calls (cluster/messages.py).
A call or stream that fails because the actor is gone raises EngineDied with its name. A
request's tokens arrive on the replica's one stream from that engine (cluster/token_feed.py).

Every awaited call is shielded (a prefill's stream excepted: `RayEngine.prefill`): when a
request's coroutine is cancelled (its client went away), the actor call it awaited is not
cancelled half-way by asyncio, so its effect is known (a route that lands after its caller
left gives its load back) and the request is aborted explicitly (`Orchestrator`). Serve
also cancels the request's Ray task then, and Ray cancels every actor call that task
submitted and that has not run yet: the calls made on the way out (releases, aborts) are
therefore submitted outside it (`_call_detached`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError

from hybridserve.cluster.messages import (
    GenerateRequest,
    PrefillResult,
    TokenEvent,
)
from hybridserve.cluster.orchestrator import EngineDied
from hybridserve.cluster.token_feed import EngineFeed


def _call_detached(method: Any, *args: Any) -> None:
    """`method.remote(*args)`, fire and forget, submitted outside the current request's Ray
    task: a client that goes away makes Serve cancel that task, and Ray then cancels every
    actor call the task submitted that has not run yet, which dropped releases and aborts
    made on the way out (router load never given back, requests left running)."""
    call = functools.partial(method.remote, *args)
    asyncio.get_running_loop().call_soon(call, context=contextvars.Context())


class RayEngine:
    """`feed`: this replica's token stream from the engine (one per engine, shared by every
    request that runs there)."""

    def __init__(self, name: str, handle: Any, feed: EngineFeed) -> None:
        self.name = name
        self.handle = handle
        self.feed = feed

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.shield(getattr(self.handle, method).remote(*args))
        except RayActorError as exc:
            raise EngineDied(self.name) from exc

    async def _stream(self, request_id: str, method: str, *args: Any) -> AsyncIterator[TokenEvent]:
        """Ask the engine to send `request_id`'s events to this replica's feed, then yield
        them."""
        queue = await self.feed.open(request_id)
        try:
            await self._call(method, *args, self.feed.subscriber)
        except BaseException:
            self.feed.close(request_id)
            raise
        async for event in self.feed.events(request_id, queue):
            yield event

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        return self._stream(request.request_id, "generate", request.to_dict())

    async def expect(self, request_id: str, num_choices: int = 1) -> tuple[str, int]:
        host, port = await self._call("expect", request_id, num_choices)
        return str(host), int(port)

    async def prefill(
        self, request: GenerateRequest, address: tuple[str, int]
    ) -> AsyncGenerator[TokenEvent | PrefillResult, None]:
        """One call for the request: the first token's event comes on this replica's feed as
        soon as the engine has it (none if the engine refused the request), then the call's
        reply, the PrefillResult. Not shielded: closing it early cancels the call, and the
        engine then drops the request."""
        request_id = request.request_id
        queue = await self.feed.open(request_id)
        call = self.handle.prefill.remote(request.to_dict(), list(address), self.feed.subscriber)
        reply = asyncio.ensure_future(call)
        first = asyncio.ensure_future(queue.get())
        try:
            # The reply can come first: the transfer may beat the feed, and a refused request
            # has no first token.
            await asyncio.wait({first, reply}, return_when=asyncio.FIRST_COMPLETED)
            if first.done() or (await self._result(reply)).status != "error":
                event = await first
                if event is None:
                    raise self.feed.failure()
                yield event
            yield await self._result(reply)
        finally:
            first.cancel()
            self.feed.close(request_id)
            if not reply.done():
                ray.cancel(call)

    async def _result(self, reply: asyncio.Future[dict[str, Any]]) -> PrefillResult:
        try:
            return PrefillResult.from_dict(await reply)
        except RayActorError as exc:
            raise EngineDied(self.name) from exc

    async def recover(self, request: GenerateRequest, delivered: int, reason: str) -> None:
        await self._call("recover", request.to_dict(), delivered, reason)

    def follow(self, request_id: str) -> AsyncIterator[TokenEvent]:
        return self._stream(request_id, "follow", request_id)

    async def release(self, request_id: str) -> None:
        await self._call("release", request_id)

    async def abort(self, request_id: str) -> None:
        # NOTE: not awaited: it runs while the request's caller is being torn down.
        _call_detached(self.handle.abort, request_id)


class RayRouter:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def route(self, token_ids: list[int], cache_salt: str | None) -> dict[str, Any]:
        call = asyncio.ensure_future(self.handle.route.remote(token_ids, cache_salt))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The route is counted against its engines' load when it lands: give it back.
            call.add_done_callback(self._release_unused)
            raise

    def _release_unused(self, call: asyncio.Future[dict[str, Any]]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        for engine in call.result().get("incarnations", {}):
            _call_detached(self.handle.release, engine)

    async def release(self, engine: str) -> None:
        _call_detached(self.handle.release, engine)  # fire and forget
