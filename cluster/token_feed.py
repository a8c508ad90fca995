"""Token events from an engine actor to an ingress replica: one stream per (replica, engine),
one message per engine step.

A Ray streaming call per request puts every token of every request through its own Ray
object, report and await: 32 streams cost 32 of them per engine step, in the engine actor,
in Ray and in the ingress, on the cores the engine steps on. Instead each ingress replica
subscribes once to each engine it uses, and the engine sends, per step, one `TokenBatch`
with the events of every request of that replica:

    ingress replica                                   engine actor
    EngineFeed ── subscribe(subscriber) ─────────────▶ TokenOutbox   (one long-lived stream)
       ◀─────────── TokenBatch per step ─────────────
    RayEngine.generate ── generate(request, subscriber) ▶ worker.submit(request, outbox.push)
    RayEngine.follow   ── follow(request_id, subscriber) ▶ worker.attach(request_id, outbox.push)

The feed hands each event to the queue of its request; a request that its caller gave up
is aborted explicitly (the orchestrator), as before. If the engine actor dies, its stream
fails and every request still open on the feed ends with EngineDied. If the replica goes
away, its stream ends on the engine side and every request it left open there is aborted.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError

from hybridserve.cluster.messages import GenerateRequest, TokenBatch, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied

if TYPE_CHECKING:
    from hybridserve.cluster.worker import EngineWorker

logger = logging.getLogger(__name__)


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


class EngineFeed:
    """Ingress side: this replica's subscription to one engine actor, opened on first use,
    and the queue of each request that waits for events from it."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle
        self.subscriber = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, asyncio.Queue[TokenEvent | None]] = {}
        self._opened: asyncio.Future[None] | None = None
        self.dead = False

    async def open(self, request_id: str) -> asyncio.Queue[TokenEvent | None]:
        """A queue for `request_id`'s events, registered before the engine is asked to run
        or stream the request, so none is missed. Raises EngineDied if the engine is gone."""
        if self._opened is None:
            self._opened = asyncio.get_running_loop().create_future()
            # Outside the current request's Ray task: when a client goes away, Serve cancels
            # that task and Ray every actor call it made, which would end the subscription
            # of every other request too.
            asyncio.get_running_loop().create_task(self._read(), context=contextvars.Context())
        await asyncio.shield(self._opened)
        if self.dead:
            raise EngineDied(self.name)
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        """Later events of `request_id` are dropped."""
        self._queues.pop(request_id, None)

    async def events(
        self, request_id: str, queue: asyncio.Queue[TokenEvent | None]
    ) -> AsyncIterator[TokenEvent]:
        """The request's events up to its final one; EngineDied if the engine goes first.
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
                    raise EngineDied(self.name)
                yield event
                if event.finished:
                    return
        finally:
            self.close(request_id)

    async def _read(self) -> None:
        assert self._opened is not None
        stream = self.handle.subscribe.options(num_returns="streaming").remote(self.subscriber)
        try:
            async for ref in stream:
                batch = TokenBatch.from_dict(await ref)
                if not self._opened.done():
                    self._opened.set_result(None)
                for event in batch.events:
                    queue = self._queues.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
        except RayActorError:
            pass  # reported below, as EngineDied to every open request
        except Exception:
            logger.exception("engine %s: its token stream failed", self.name)
        finally:
            self.dead = True
            logger.warning("engine %s: token stream to this replica ended", self.name)
            if not self._opened.done():
                self._opened.set_result(None)
            for queue in self._queues.values():
                queue.put_nowait(None)
