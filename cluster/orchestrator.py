"""One request through the service, step by step: route -> prefill -> transfer -> decode ->
stream. The ingress runs it for every request; engines are reached through `EngineClient`
(Ray actor handles in the service, `EngineHost`s directly in tests).

    1. route     the router admits the request (or refuses it: RouteRefused, before anything
                 is allocated) and picks the decode engine, and a prefill engine unless the
                 decode engine should run the whole request (colocated engines, or a short
                 new part of a conversation it holds)
    2. expect    the decode engine opens the request's stream
    3. prefill   the prefill engine computes the prompt and the first token and ships the
                 state to the decode engine's address; the first token streams at once.
                 Sent without waiting for expect's reply (a round trip of ~0.7 ms on the
                 first token): a transfer that reaches the decode engine ahead of its
                 expect waits there for it
    4. decode    the decode engine continues from the transferred state; if the transfer
                 failed (seen by either side, or the prefill engine died), the decode
                 engine's `transfer_failure_policy` decides, in one place (the engine):
                 recompute there, or end the request with an error
    5. stream    the decode engine's tokens, after the first one (no token travels twice)

A prefill engine that dies only fails its transfer (the decode engine recomputes, or, when
the transfer had landed, continues, and sends the first token itself if the caller never got
it); a decode engine that dies ends the request with an error event. Either is reported as
dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

from hybridserve.cluster.messages import GenerateRequest, PrefillResult, Route, TokenEvent

logger = logging.getLogger(__name__)


class StaleTopology(RuntimeError):
    """The router chose an engine this caller holds no current handle for (it was restarted,
    or started after the caller's topology was taken): refresh the topology and retry."""


class EngineDied(RuntimeError):
    """An engine stopped answering (its actor died) while serving a request."""

    def __init__(self, name: str) -> None:
        super().__init__(f"engine {name} died while serving the request")
        self.name = name


class FeedLost(ConnectionError):
    """The connection to an engine broke while the engine itself still answers over Ray: the
    requests on it end with this error (the engine aborts them), and the engine keeps
    serving. A prefill's is a failed transfer: the decode engine recovers it."""


class EngineClient(Protocol):
    """An engine as the orchestrator drives it. Raises EngineDied if the engine is gone."""

    @property
    def address(self) -> tuple[str, int] | None:
        """Where prefill engines send its transfers (a decode engine's; else None)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    async def expect(self, request_id: str, num_choices: int = 1) -> None: ...

    def prefill(
        self, request: GenerateRequest, address: tuple[str, int]
    ) -> AsyncGenerator[TokenEvent | PrefillResult, None]: ...

    async def recover(self, request: GenerateRequest, delivered: int, reason: str) -> None: ...

    def follow(self, request_id: str) -> AsyncIterator[TokenEvent]: ...

    async def release(self, request_id: str) -> None: ...

    async def abort(self, request_id: str) -> None: ...


class RouterClient(Protocol):
    async def route(self, token_ids: list[int], cache_salt: str | None) -> Route:
        """Where the request runs; raises RouteRefused when no engine takes it now."""

    async def release(self, engine: str) -> None: ...


class Orchestrator:
    def __init__(
        self,
        router: RouterClient,
        engines: dict[str, EngineClient],
        on_engine_dead: Callable[[str], Awaitable[None]],
        incarnations: Mapping[str, int] | None = None,
    ) -> None:
        """`incarnations`: the incarnation of each engine in `engines` (None: not checked)."""
        self.router = router
        self.engines = engines
        self.on_engine_dead = on_engine_dead
        self.incarnations = incarnations

    async def run(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """The request's TokenEvents, ending with one that carries a finish reason. If the
        consumer stops early, the request is aborted on every engine that holds it."""
        request_id = request.request_id
        # 1. route
        route = await self.router.route(request.prompt_token_ids, request.cache_salt)
        decode_name, prefill_name = route.decode, route.prefill
        if self.incarnations is not None and any(
            self.incarnations.get(name) != incarnation
            for name, incarnation in route.incarnations.items()
        ):
            for name in route.engines:
                await self.router.release(name)
            raise StaleTopology(f"request {request_id}: routed to {route.incarnations}")
        logger.info(
            "request %s: %s -> %s (%s, expect %d cached)",
            request_id,
            prefill_name or "-",
            decode_name,
            route.reason,
            route.expected_cached_tokens,
        )
        decode = self.engines[decode_name]
        holding = route.engines
        finished = False
        try:
            if prefill_name is None:
                events = decode.generate(request)
            else:
                events = self._disaggregated(request, prefill_name, decode_name, holding)
            # 5. stream (closed here, so that what it holds open goes now, not when collected)
            async with contextlib.aclosing(events):
                async for event in events:
                    finished = event.finished
                    yield event
                    if finished:
                        return
            raise EngineDied(decode_name)  # the stream ended without a final event
        except EngineDied as dead:
            await self.on_engine_dead(dead.name)
            finished = True
            yield TokenEvent(request_id, 0, finish_reason="error", error=str(dead))
        finally:
            for name in holding:
                await self.router.release(name)
            if not finished:
                await self._abort_everywhere(request_id, prefill_name, decode_name)

    async def _disaggregated(
        self, request: GenerateRequest, prefill_name: str, decode_name: str, holding: list[str]
    ) -> AsyncIterator[TokenEvent]:
        """Steps 2-4, then the decode engine's stream. The first token goes out as soon as
        the prefill engine has it, while its transfer is still under way; the prefill
        engine's load is given back (`holding`) once it reports how the transfer went."""
        request_id = request.request_id
        decode = self.engines[decode_name]
        address = decode.address
        if address is None:
            raise RuntimeError(f"engine {decode_name} takes no transfers: not a decode engine")
        # 2. expect: its reply is awaited before anything reaches the caller or the decode
        # engine's other calls (the transfer waits there for the expect, if it comes first)
        expected = asyncio.ensure_future(decode.expect(request_id, request.params.n))
        # 3. prefill (and the transfer it starts): the first token, then how the transfer went
        first: TokenEvent | None = None
        result: PrefillResult | None = None
        try:
            prefill = self.engines[prefill_name].prefill(request, address)
            async with contextlib.aclosing(prefill) as run:
                while True:
                    try:
                        message = await anext(run)
                    except StopAsyncIteration:
                        break
                    except (EngineDied, FeedLost) as lost:  # the prefill engine's (the
                        if isinstance(lost, EngineDied):  # expect is awaited apart)
                            await self.on_engine_dead(lost.name)
                        if result is None:
                            result = PrefillResult(request_id, "transfer_failed", detail=str(lost))
                        break
                    if isinstance(message, PrefillResult):
                        result = message
                        continue
                    first = message
                    await expected
                    if first.finished:  # ended by its first token, or refused: no transfer
                        with contextlib.suppress(EngineDied):  # a dead one holds nothing
                            await decode.release(request_id)
                        yield first
                        return
                    yield first  # to the client now, while the transfer is under way
            await expected
        finally:
            if not expected.done():
                expected.cancel()  # a caller gone early: run() aborts it on the decode engine
            elif not expected.cancelled():
                expected.exception()  # raised above, or superseded by what ended the request
        if result is None:
            result = PrefillResult(request_id, "transfer_failed", detail="no prefill result")
        holding.remove(prefill_name)
        await self.router.release(prefill_name)
        if result.status == "error":
            await decode.release(request_id)
            yield TokenEvent(request_id, 0, finish_reason="error", error=result.detail)
            return
        # 4. decode: from the transferred state, or per the decode engine's failure policy
        if result.status == "transfer_failed":
            logger.warning(
                "request %s: transfer from %s failed (%s)", request_id, prefill_name, result.detail
            )
            delivered = len(first.token_ids) if first is not None else 0
            await decode.recover(request, delivered, result.detail)
        cached = first.num_cached_tokens if first is not None else None
        async for event in self._reported(decode.follow(request_id), cached):
            yield event

    @staticmethod
    async def _reported(
        events: AsyncIterator[TokenEvent], cached: int | None
    ) -> AsyncIterator[TokenEvent]:
        """Decode events, reporting the prefill engine's reuse as the request's cached
        tokens (the decode engine received, or recomputed, what prefill reused)."""
        async for event in events:
            yield event if cached is None else dataclasses.replace(event, num_cached_tokens=cached)

    async def _abort_everywhere(
        self, request_id: str, prefill_name: str | None, decode_name: str
    ) -> None:
        for name in (decode_name, prefill_name):
            engine = self.engines.get(name) if name is not None else None
            if engine is not None:
                # Gone already: nothing of the request is left there.
                with contextlib.suppress(EngineDied):
                    await engine.abort(request_id)
