"""The ingress's view of a request's events (cluster/openai/choices.py): text per choice, and the
latencies the metrics report. Oracle: the tokenizer's own decode of the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hybridserve.cluster.messages import TokenEvent
from hybridserve.cluster.openai.choices import ChoiceStream, RequestStats, choice_deltas
from hybridserve.cluster.openai.protocol import OpenAIError
from hybridserve.workers.models.tiny import tiny_tokenizer


async def arriving(events: list[tuple[float, TokenEvent]], clock: list[float]):
    """`events`, each after the clock is set to its arrival time."""
    for at, event in events:
        clock[0] = at
        yield event


def run(
    events: list[tuple[float, TokenEvent]], stats: RequestStats | None = None
) -> tuple[str, RequestStats]:
    tokenizer = tiny_tokenizer()
    clock = [0.0]
    choices = [ChoiceStream(0, tokenizer, [], include_stop=False)]
    stats = stats if stats is not None else RequestStats()

    async def texts(deltas: AsyncIterator) -> str:
        return "".join([delta.text async for delta in deltas])

    stream = choice_deltas(arriving(events, clock), choices, stats, lambda: clock[0], 0.0)
    return asyncio.run(texts(stream)), stats


def test_tokens_that_arrive_together_share_their_gap():
    """A first token, then chunks of 3 and 2 (a stream interval): 1 TTFT, one latency per
    later token, each chunk's gap split over its tokens."""
    tokens = [40, 41, 42, 43, 44, 45]
    text, stats = run(
        [
            (0.010, TokenEvent("r", 0, tokens[:1])),
            (0.040, TokenEvent("r", 1, tokens[1:4])),
            (0.060, TokenEvent("r", 4, tokens[4:], finish_reason="length")),
        ]
    )
    assert text == tiny_tokenizer().decode(tokens)
    assert stats.ttft == pytest.approx(0.010)
    assert stats.itl == pytest.approx([0.010] * 5)
    # Tokens that came with the first one: no wait between them.
    _, joined = run(
        [
            (0.010, TokenEvent("r", 0, tokens[:3])),
            (0.040, TokenEvent("r", 3, tokens[3:], finish_reason="length")),
        ]
    )
    assert joined.itl == pytest.approx([0.0, 0.0, 0.010, 0.010, 0.010])
    assert (stats.num_tokens, stats.finish_reason) == (6, "length")


def test_a_repeated_token_is_skipped_and_a_missing_one_is_an_error():
    """A recompute may resend tokens the caller has (skipped); an event past the tokens the
    caller has would leave a hole in the text: a server error, not wrong text."""
    tokens = [40, 41, 42, 43]
    text, _ = run(
        [
            (0.01, TokenEvent("r", 0, tokens[:2])),
            (0.02, TokenEvent("r", 1, tokens[1:], finish_reason="length")),
        ]
    )
    assert text == tiny_tokenizer().decode(tokens)
    stats = RequestStats()
    with pytest.raises(OpenAIError, match=r"tokens 1\.\.2 never arrived"):
        run([(0.01, TokenEvent("r", 0, tokens[:1])), (0.02, TokenEvent("r", 2, tokens[2:]))], stats)
    assert stats.finish_reason == "error"  # counted as a failed request
