"""A request's choices becoming text: the ingress's view of the TokenEvents of one request.

Each choice (n > 1 requests have several, events carry their `index`) is detokenized
incrementally and cut at its stop strings on its own; its token ids and logprobs stay aligned
with the text that goes out. A choice that hits a stop string is done for the client even
though its engine may still generate it: once every choice is done the caller closes the
event stream, which aborts whatever is left.

    events ──> ChoiceStream[index].feed ──> ChoiceDelta(index, text, token ids, logprobs,
                                                        finish reason, holding)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridserve.cluster.messages import TokenEvent
from hybridserve.cluster.openai.protocol import OpenAIError
from hybridserve.workers.core.detokenizer import Detokenizer
from hybridserve.workers.core.outputs import TokenLogprobs
from hybridserve.workers.core.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token of token_ids, when asked for
    finish_reason: str | None
    # Text for these tokens is still held back (an incomplete character, a possible stop
    # string): their chunk waits for it, so a chunk's ids and text stay aligned.
    holding: bool = False


@dataclass
class RequestStats:
    """What the metrics and the usage report need, over every choice."""

    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queued_s: float | None = None  # the engine's wait before scheduling it (its first report)


class ChoiceStream:
    def __init__(
        self, index: int, tokenizer: Any, stops: Sequence[str], *, include_stop: bool
    ) -> None:
        self.index = index
        self.detokenizer = Detokenizer(tokenizer)
        self.matcher = StopStringMatcher(stops)
        self.include_stop = include_stop
        self.num_tokens = 0
        self.done = False

    def feed(self, event: TokenEvent) -> ChoiceDelta | None:
        """This event's part of the choice; None once the choice is done (a stop string).
        Raises OpenAIError (500) for an event that skips tokens."""
        if self.done:
            return None
        if event.offset > self.num_tokens:  # text without those tokens would be wrong
            raise OpenAIError(
                500,
                f"choice {self.index}: tokens {self.num_tokens}..{event.offset} never arrived "
                "from the engine",
                type="server_error",
            )
        skip = max(0, self.num_tokens - event.offset)  # a recompute repeats tokens
        token_ids = event.token_ids[skip:]
        logprobs = (
            None
            if event.logprobs is None
            else [TokenLogprobs.from_wire(lp) for lp in event.logprobs[skip:]]
        )
        self.num_tokens += len(token_ids)
        final = event.finish_reason is not None
        match = self.matcher.feed(self.detokenizer.feed(token_ids, final))
        if match.stopped:
            self.done = True
            text = match.text + ((match.stop or "") if self.include_stop else "")
            return ChoiceDelta(self.index, text, token_ids, logprobs, "stop")
        if final:
            self.done = True
            text = match.text + self.matcher.flush()
            return ChoiceDelta(self.index, text, token_ids, logprobs, event.finish_reason)
        holding = self.detokenizer.holding or self.matcher.holding
        return ChoiceDelta(self.index, match.text, token_ids, logprobs, None, holding)


async def choice_deltas(
    events: AsyncIterator[TokenEvent],
    choices: list[ChoiceStream],
    stats: RequestStats,
    clock: Any,
    start: float,
) -> AsyncIterator[ChoiceDelta]:
    """Every choice's deltas as its events arrive; returns once every choice is done.
    `start` (on `clock`) is when the request arrived: its TTFT counts from there. Raises
    OpenAIError for an engine-side error (500) or abort (503)."""
    last = start
    async for event in events:
        now = clock()
        if event.token_ids:
            # Tokens that come together (a stream interval, joined events) share the gap: one
            # latency per token after the first, and their mean is the stream's.
            num_tokens = len(event.token_ids)
            if stats.ttft is None:
                stats.ttft = now - start
                stats.itl.extend([0.0] * (num_tokens - 1))  # they came with the first
            else:
                stats.itl.extend([(now - last) / num_tokens] * num_tokens)
            last = now
        stats.num_cached_tokens = event.num_cached_tokens
        if stats.queued_s is None:
            stats.queued_s = event.queued_s
        if event.prompt_logprobs is not None:
            stats.prompt_logprobs = [
                None if lp is None else TokenLogprobs.from_wire(lp) for lp in event.prompt_logprobs
            ]
        if event.finish_reason == "error":
            stats.finish_reason = "error"
            raise OpenAIError(500, event.error or "the request failed", type="server_error")
        if event.finish_reason == "abort":
            stats.finish_reason = "abort"
            raise OpenAIError(503, "the request was aborted by the engine")
        if not 0 <= event.index < len(choices):
            raise OpenAIError(500, f"an engine sent choice {event.index} of {len(choices)}")
        try:
            delta = choices[event.index].feed(event)
        except OpenAIError as exc:  # tokens went missing on the way: a bug, not bad input
            stats.finish_reason = "error"
            logger.error("request %s: %s", event.request_id, exc.message)
            raise
        if delta is None:
            continue
        stats.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            stats.finish_reason = delta.finish_reason
        yield delta
        if all(choice.done for choice in choices):
            return
