"""The ingress <-> engine messages: msgpack round trips, and a wrong version or kind refused
by name."""

from __future__ import annotations

import msgpack
import pytest

from hybridserve.cluster.messages import (
    MESSAGES_VERSION,
    FeedCall,
    FeedHello,
    FeedReply,
    FeedTicket,
    GenerateRequest,
    MessageError,
    PrefillResult,
    PromptChain,
    Route,
    RouteRefusal,
    TokenBatch,
    TokenEvent,
)

EVENT = TokenEvent(
    "r1", 2, [7, 8], num_cached_tokens=16, index=1, logprobs=[[7, -0.5, [[7, -0.5]]]] * 2
)
MESSAGES = [
    GenerateRequest("r1", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}, "salt", 2, 1),
    EVENT,
    TokenEvent("r1", 4, [], finish_reason="length", last=True),
    PrefillResult("r1", "handed_off", blocks_sent=3, bytes_sent=4096),
    PrefillResult("r2", "error", detail="token id 9999 is outside the vocabulary"),
    TokenBatch([EVENT, TokenEvent("r2", 0, [5], finish_reason="stop", last=True)]),
    TokenBatch([]),
    TokenBatch([EVENT], [FeedReply(3, ["10.0.0.7", 5000]), FeedReply(4, error="ValueError: x")]),
    FeedCall(3, "expect", ["r1", 1]),
    FeedCall(4, "generate", [GenerateRequest("r1", [1], {}).to_dict()]),
    FeedReply(5, PrefillResult("r1", "finished").to_dict()),
    FeedTicket("10.0.0.7", 41234, "5f0c"),
    FeedHello("5f0c"),
    Route("prefill-0", "decode-1", 512, "snapshot-match", {"prefill-0": 0, "decode-1": 2}),
    Route(None, "decode-0", 0, "decode-holder"),
    RouteRefusal(429, "the service is at capacity"),
    PromptChain([5, 6, 7, 8, 9], [b"\x01" * 32, b"\x02" * 32], 4),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_through_msgpack(message):
    wire = msgpack.packb(message.to_dict())
    assert type(message).from_dict(msgpack.unpackb(wire)) == message


def test_a_batch_carries_each_event_versioned():
    data = TokenBatch([EVENT]).to_dict()
    assert data["v"] == MESSAGES_VERSION and data["kind"] == "token_batch"
    assert data["events"][0]["v"] == MESSAGES_VERSION and data["events"][0]["kind"] == "tokens"


def test_another_version_or_kind_is_refused_by_name():
    data = TokenBatch([EVENT]).to_dict()
    with pytest.raises(MessageError, match=f"token_batch message of version {MESSAGES_VERSION}"):
        TokenBatch.from_dict(data | {"v": MESSAGES_VERSION - 1})
    with pytest.raises(MessageError, match="expected a tokens message"):
        TokenEvent.from_dict(data)
    with pytest.raises(MessageError, match="unknown fields"):
        TokenEvent.from_dict(EVENT.to_dict() | {"surprise": 1})


def test_an_event_joins_the_one_that_continues_it():
    lp = [[7, -0.5, [[7, -0.5]]]]
    first = TokenEvent(
        "r1", 2, [7], num_cached_tokens=16, index=1, logprobs=lp, prompt_logprobs=[None]
    )
    last = TokenEvent("r1", 3, [8, 9], "length", 16, index=1, last=True, logprobs=lp * 2)
    assert first.joined(last) == TokenEvent(
        "r1",
        2,
        [7, 8, 9],
        "length",
        16,
        index=1,
        last=True,
        logprobs=lp * 3,
        prompt_logprobs=[None],
    )
    plain = TokenEvent("r1", 2, [7], index=1)
    assert plain.joined(TokenEvent("r1", 3, [8], index=1)) == TokenEvent("r1", 2, [7, 8], index=1)


@pytest.mark.parametrize(
    "following",
    [
        TokenEvent("r1", 3, [8], index=0),  # another choice
        TokenEvent("r1", 2, [7], index=1),  # a repeat (a recompute starts over)
        TokenEvent("r1", 4, [9], index=1),  # a gap
        TokenEvent("r1", 3, [8], index=1, logprobs=[[8, -1.0, []]]),  # logprobs from here on
    ],
)
def test_events_that_do_not_continue_each_other_stay_apart(following):
    assert TokenEvent("r1", 2, [7], index=1).joined(following) is None


@pytest.mark.parametrize(
    "ended",
    [
        TokenEvent("r1", 2, [7], finish_reason="stop", index=1),  # the choice ended
        TokenEvent("r1", 2, [7], finish_reason="error", error="boom", index=1),
        TokenEvent("r1", 2, [7], index=1, last=True),
    ],
)
def test_nothing_joins_an_event_that_ends_something(ended):
    assert ended.joined(TokenEvent("r1", 3, [8], index=1)) is None
