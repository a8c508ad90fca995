"""One request's token events on an engine host, on their way to its caller's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridserve.cluster.messages import PrefillResult, TokenEvent
from hybridserve.workers import RequestOutput

# Takes a request's token events on the caller's loop (a subscriber's outbox).
TokenSink = Callable[[TokenEvent], None]


@dataclass
class RequestStream:
    """Where a request's events go, on the caller's loop: its `sink` once one is attached
    (`submit`, `attach`), its queue until then."""

    loop: asyncio.AbstractEventLoop
    num_choices: int = 1
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    sink: TokenSink | None = None
    num_sent: dict[int, int] = field(default_factory=dict)  # per choice: tokens queued
    finished: set[int] = field(default_factory=set)  # choices that ended
    prefill_done: asyncio.Future[PrefillResult] | None = None
    decode_address: tuple[str, int] | None = None
    # The engine is done with the request here (its final output, or the prefill's transfer
    # outcome): closing the stream has nothing to abort. A failed NIXL send's pages stay
    # with the sender until the lease ends, as a late write may still land.
    ended: bool = False
    # The engine's first output for choice 0 (all its tokens then, the prefill side's first
    # included): what `EngineHost.recover` resends if the caller never got that token.
    first_output: RequestOutput | None = None
    accepted_any: bool = False  # an event went to the caller (on the loop)

    def put(self, event: TokenEvent) -> None:
        self.loop.call_soon_threadsafe(self.accept, event)

    def accept(self, event: TokenEvent) -> None:
        """On the loop."""
        if event.finished and not self.accepted_any:
            # A prefill that ended with its first token, or before it (refused, failed):
            # nothing to ship. Settled ahead of the sink, which may close the stream. After
            # the first token, only the transfer's outcome settles it (`_shipped`).
            self.settle(PrefillResult(event.request_id, "finished"))
        self.accepted_any = True
        if self.sink is not None:
            self.sink(event)
        else:
            self.queue.put_nowait(event)

    def settle(self, result: PrefillResult) -> None:
        """On the loop: a prefill's outcome, unless it has one already."""
        if self.prefill_done is not None and not self.prefill_done.done():
            self.prefill_done.set_result(result)

    def put_first(self, event: TokenEvent) -> None:
        """On the loop: `event` ahead of every event still queued."""
        queued = [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        self.accept(event)
        for later in queued:
            self.queue.put_nowait(later)

    def next_event(
        self, request_id: str, output: RequestOutput, stream_interval: int
    ) -> TokenEvent | None:
        """On the stepping thread: the event with the new tokens of `output`'s choice. None
        while fewer than `stream_interval` new tokens wait, unless nothing was sent yet or
        the choice ended (an event costs the path to the client more CPU than the step
        spends on the row: on a small machine, the engine's CPU)."""
        index = output.index
        if index == 0 and self.first_output is None:
            self.first_output = output
        sent = self.num_sent.get(index, 0)
        waiting = len(output.token_ids) - sent
        if output.finish_reason is None and sent > 0 and waiting < stream_interval:
            return None
        new, logprobs = output_slice(output, sent)
        if output.finish_reason is not None:
            self.finished.add(index)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and index == 0 and sent == 0:
            prompt_logprobs = [
                None if lp is None else lp.to_wire() for lp in output.prompt_logprobs
            ]
        event = TokenEvent(
            request_id,
            sent,
            new,
            output.finish_reason,
            output.num_cached_tokens,
            output.error,
            index=index,
            last=len(self.finished) >= self.num_choices,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            queued_s=output.queued_s if index == 0 and sent == 0 else None,
        )
        self.num_sent[index] = sent + len(new)
        self.ended = event.finished
        return event

    def end(self, request_id: str, reason: str, error: str | None = None) -> None:
        """A last event: the request ended (aborted, or failed) for every choice."""
        offset = self.num_sent.get(0, 0)
        self.put(TokenEvent(request_id, offset, finish_reason=reason, error=error, last=True))


def accept_all(items: list[tuple[RequestStream, TokenEvent]]) -> None:
    """On the loop: each event to its stream, in order."""
    for stream, event in items:
        stream.accept(event)


def dispatch(deliveries: list[tuple[RequestStream, TokenEvent]]) -> None:
    """From the stepping thread: a step's events, in one callback per event loop (one
    wake-up per step, and a subscriber's outbox sends them as one batch)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent]]] = {}
    for stream, event in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, items in by_loop.items():
        if not loop.is_closed():  # a caller that went with its loop has nothing to take
            loop.call_soon_threadsafe(accept_all, items)


def output_slice(
    output: RequestOutput, start: int, end: int | None = None
) -> tuple[list[int], list[list[Any]] | None]:
    """Output tokens [start, end) and their logprobs in wire form (None when not asked for)."""
    logprobs = None
    if output.logprobs is not None:
        logprobs = [lp.to_wire() for lp in output.logprobs[start:end]]
    return list(output.token_ids[start:end]), logprobs
