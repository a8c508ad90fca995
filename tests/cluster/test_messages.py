"""The ingress <-> engine messages: msgpack round trips, and a wrong version or kind refused
by name."""

from __future__ import annotations

import msgpack
import pytest

from hybridserve.cluster.messages import (
    MESSAGES_VERSION,
    GenerateRequest,
    MessageError,
    PrefillResult,
    TokenBatch,
    TokenEvent,
)

EVENT = TokenEvent(
    "r1", 2, [7, 8], num_cached_tokens=16, index=1, logprobs=[[7, -0.5, [[7, -0.5]]]] * 2
)
MESSAGES = [
    GenerateRequest("r1", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}, "salt", 2),
    EVENT,
    TokenEvent("r1", 4, [], finish_reason="length", last=True),
    PrefillResult("r1", "handed_off", first=EVENT, blocks_sent=3, bytes_sent=4096),
    PrefillResult("r2", "error", detail="token id 9999 is outside the vocabulary"),
    TokenBatch([EVENT, TokenEvent("r2", 0, [5], finish_reason="stop", last=True)]),
    TokenBatch([]),
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
