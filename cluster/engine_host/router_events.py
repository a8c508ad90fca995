"""An engine's cache events to the router (its prefix index), on a feed connection of the
engine's own (cluster/transport/token_feed.py), as an ingress replica routes on its own.

A Ray call per batch cost the engine's stepping thread 0.1-0.7 ms a step with events (most
steps under load: every filled block is one), and held the GIL while the engine's event loop
waited for it to send the step's tokens: about 0.4 ms of an idle engine's first token. Here
the stepping thread only hands the batch to the loop.

The batches go out one call at a time, those handed over meanwhile joined into the next, each
call numbered per engine incarnation. The router applies them in that order and drops one it
has applied already (a call resent after the connection broke may have landed); its reply is
the acknowledgement `applied()` waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hybridserve.cluster.orchestrator import EngineDied, FeedLost
from hybridserve.cluster.transport.token_feed import EngineCallFailed, EngineFeed

logger = logging.getLogger(__name__)

# After the connection to the router broke, the next try waits this long, doubling up to
# the most.
RESEND_AFTER_S, RESEND_AFTER_MAX_S = 0.1, 5.0


class RouterEvents:
    """Lives on the engine actor's event loop; `send` may be called from any thread."""

    def __init__(
        self,
        engine: str,
        incarnation: int,
        new_feed: Callable[[], EngineFeed],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """`new_feed()`: a connection to the router (another after one broke)."""
        self.engine, self.incarnation = engine, incarnation
        self._new_feed = new_feed
        self._loop = loop
        self.num_batches = 0  # handed over by `send`
        self.num_applied = 0  # of those, answered by the router
        self.stopped: str | None = None  # why no more batches go (the router is gone)
        self._feed: EngineFeed | None = None
        self._events: list[dict[str, Any]] = []  # handed over, not sent yet
        self._num_waiting = 0  # batches in `_events`
        self._seq = 0  # the next call's number
        self._ready = asyncio.Event()
        self._applied = asyncio.Condition()
        self._forwarding = loop.create_task(self._forward())

    def send(self, engine: str, events: list[dict[str, Any]]) -> None:
        """An EngineHost event sink: the engine's next batch. One call at a time (the
        host's flushes hold its flush lock)."""
        self.num_batches += 1
        self._loop.call_soon_threadsafe(self._take, events)

    async def applied(self) -> None:
        """Returns once the router has answered every batch handed over before this call
        (applied it, or refused it: a bug, logged); RuntimeError if batches stopped going."""
        target = self.num_batches
        async with self._applied:
            await self._applied.wait_for(
                lambda: self.num_applied >= target or self.stopped is not None
            )
        if self.num_applied < target:
            raise RuntimeError(f"engine {self.engine}: cache events stopped: {self.stopped}")

    def close(self) -> None:
        self._forwarding.cancel()
        if self._feed is not None and self._feed.reading is not None:
            self._feed.reading.cancel()  # closes the connection

    def _take(self, events: list[dict[str, Any]]) -> None:
        if self.stopped is not None:
            return  # nobody to send them to
        self._events.extend(events)
        self._num_waiting += 1
        self._ready.set()

    async def _forward(self) -> None:
        try:
            self._feed = self._new_feed()
            # Now rather than with the first batch, which would wait for the ticket and the
            # connection: the first requests' events reached the index late, and routes of
            # the requests right after them missed their shared prefix.
            with contextlib.suppress(EngineDied, FeedLost):  # the first call raises it again
                await self._feed.connect()
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._num_waiting:
                    events, self._events = self._events, []
                    batches, self._num_waiting = self._num_waiting, 0
                    await self._deliver(events)
                    async with self._applied:
                        self.num_applied += batches
                        self._applied.notify_all()
        except EngineDied as gone:
            logger.error("engine %s: no more cache events: %s", self.engine, gone)
            await self._stop(str(gone))
        except Exception as exc:  # a bug
            logger.exception("engine %s: no more cache events", self.engine)
            await self._stop(repr(exc))

    async def _stop(self, reason: str) -> None:
        async with self._applied:
            self.stopped = reason
            self._events, self._num_waiting = [], 0
            self._applied.notify_all()

    async def _deliver(self, events: list[dict[str, Any]]) -> None:
        """One call with `events`, on a new connection as often as one breaks; EngineDied
        if the router is gone."""
        seq, self._seq = self._seq, self._seq + 1
        delay = RESEND_AFTER_S
        while True:
            assert self._feed is not None
            try:
                await self._feed.call("events", self.engine, self.incarnation, seq, events)
                return
            except FeedLost as lost:  # the router lives: again, on a new connection
                logger.warning("engine %s: cache events: %s; resending", self.engine, lost)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESEND_AFTER_MAX_S)
                self._feed = self._new_feed()
            except EngineCallFailed as refused:  # a bug: say so, and go on
                logger.error("engine %s: cache events refused: %s", self.engine, refused)
                return
