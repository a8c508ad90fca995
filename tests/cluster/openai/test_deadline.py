"""The request deadline of the OpenAI routes (cluster/openai/routes.py): no service needed."""

from __future__ import annotations

import asyncio

import pytest

from hybridserve.cluster.messages import TokenEvent
from hybridserve.cluster.openai.protocol import OpenAIError
from hybridserve.cluster.openai.routes import within_deadline


class Events:
    """A request's events: one token every `interval_s`; records whether it was closed (the
    orchestrator aborts the request on every engine when that happens)."""

    def __init__(self, num_tokens: int, interval_s: float) -> None:
        self.num_tokens = num_tokens
        self.interval_s = interval_s
        self.closed = False

    async def run(self):
        try:
            for i in range(self.num_tokens):
                await asyncio.sleep(self.interval_s)
                last = i == self.num_tokens - 1
                yield TokenEvent("r", i, [i], finish_reason="length" if last else None)
        finally:
            self.closed = True


async def collect(events: Events, timeout_s: float) -> list[TokenEvent]:
    return [event async for event in within_deadline(events.run(), timeout_s, "r")]


def test_a_request_within_its_deadline_is_untouched():
    events = Events(num_tokens=5, interval_s=0.01)
    received = asyncio.run(collect(events, timeout_s=5.0))
    assert [e.token_ids for e in received] == [[0], [1], [2], [3], [4]]
    assert events.closed


def test_a_request_past_its_deadline_ends_with_a_504_and_is_closed():
    events = Events(num_tokens=100, interval_s=0.05)
    received: list[TokenEvent] = []

    async def consume() -> None:
        async for event in within_deadline(events.run(), 0.3, "r"):
            received.append(event)

    with pytest.raises(OpenAIError) as error:
        asyncio.run(consume())
    assert error.value.status == 504 and error.value.code == "request_timeout"
    assert "request_timeout_s=0.3" in error.value.message
    assert 0 < len(received) < 100
    assert events.closed  # the request is aborted wherever it runs
