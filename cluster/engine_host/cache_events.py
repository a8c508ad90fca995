"""An engine's cache events on their way to the routers: queued by the engine as it emits them
(under the host's engine lock), sent by the stepping thread after each step, in order, to
every router's sink; a router that joins late gets what the cache holds first."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridserve.workers.cache.events import CacheEvent, event_to_dict

if TYPE_CHECKING:
    from hybridserve.workers import Engine

# A router's receiver: (engine name, a batch of events in wire form).
EventSink = Callable[[str, list[dict[str, Any]]], None]


class CacheEventFanout:
    """The engine's cache-event subscriber (`Engine.subscribe`) inside an EngineHost."""

    def __init__(self, engine_name: str, lock: threading.Lock) -> None:
        """`lock`: the host's engine lock, held while the engine emits events."""
        self.engine_name = engine_name
        self._lock = lock
        self._sinks: dict[str, EventSink] = {}  # by name: the routers
        self._pending: list[CacheEvent] = []
        # One flusher at a time: batches leave in the order the engine emitted them.
        self._flush_lock = threading.Lock()

    def on_cache_events(self, events: list[CacheEvent]) -> None:
        """Engine callback (under the lock): queue for the stepping thread to flush in order."""
        self._pending.extend(events)

    def flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                events, self._pending = self._pending, []
            self._send(events)

    def _send(self, events: list[CacheEvent]) -> None:
        if events and self._sinks:
            batch = [event_to_dict(e) for e in events]
            for sink in list(self._sinks.values()):
                sink(self.engine_name, batch)

    def add_sink(self, name: str, sink: EventSink, engine: Engine) -> None:
        """Send the cache events to `sink` too (replacing one of that name): first what
        `engine`'s cache holds now, as one batch, then every batch after it. Events emitted
        before and not sent yet go to the sinks already there first, so none reaches `sink`
        twice."""
        with self._flush_lock:
            with self._lock:
                engine.publish_cache_events()  # into _pending
                events, self._pending = self._pending, []
                state = engine.cache.state_events()
            self._sinks.pop(name, None)
            self._send(events)
            self._sinks[name] = sink
            if state:
                sink(self.engine_name, [event_to_dict(e) for e in state])
