"""Stream chunks of one reply: tokens wait for their text only while text is held back."""

from __future__ import annotations

import asyncio
from typing import Any

from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.openai.protocol import CompletionRequest
from hybridserve.cluster.openai.reply import Reply
from hybridserve.cluster.openai.response_body import ResponseMeta
from hybridserve.workers.models.tiny import tiny_tokenizer


def chunks(
    tokenizer: Any, steps: list[list[int]], whole: bool = False, **body: Any
) -> list[dict[str, Any]]:
    """The stream chunks' choices (`whole`: the chunks) of a completion whose engine sends
    `steps` (one event each)."""
    request = CompletionRequest(model="m", prompt=[1, 2], stream=True, **body)
    generate = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling={})
    reply = Reply(tokenizer, request, generate, ResponseMeta.new("m", chat=False))

    async def events():
        offset = 0
        for i, token_ids in enumerate(steps):
            finish = "length" if i == len(steps) - 1 else None
            yield TokenEvent("r", offset, token_ids, finish_reason=finish, last=finish is not None)
            offset += len(token_ids)

    async def run() -> list[dict[str, Any]]:
        out = []
        async for delta in reply.deltas(events()):
            chunk = reply.chunk(delta)
            if chunk is not None:
                out.append(chunk if whole else chunk["choices"][0])
        return out

    return asyncio.run(run())


def test_without_a_tokenizer_every_step_s_tokens_go_out_at_once():
    sent = chunks(None, [[5], [6], [7], [8]], return_token_ids=True)
    assert [c["token_ids"] for c in sent] == [[5], [6], [7], [8]]
    assert [c["text"] for c in sent] == ["", "", "", ""]


def test_tokens_of_an_incomplete_character_wait_for_the_rest_of_it():
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode("a🙂b", add_special_tokens=False)  # the emoji is 4 bytes
    steps = [[t] for t in token_ids]
    sent = chunks(tokenizer, steps, return_token_ids=True)
    assert "".join(c["text"] for c in sent) == "a🙂b"
    assert [t for c in sent for t in c["token_ids"]] == token_ids
    emoji = next(c for c in sent if "🙂" in c["text"])
    assert len(emoji["token_ids"]) == len(tokenizer.encode("🙂", add_special_tokens=False))


def test_tokens_that_may_start_a_stop_string_wait_until_it_is_decided():
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode("xyz", add_special_tokens=False)
    sent = chunks(tokenizer, [[t] for t in token_ids], return_token_ids=True, stop=["yq"])
    assert [c["text"] for c in sent] == ["x", "yz"]  # "y" might have begun "yq"
    assert [t for c in sent for t in c["token_ids"]] == token_ids


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk():
    """vLLM's `stream_options.continuous_usage_stats` (GuideLLM sends it): each chunk carries
    the prompt's tokens and the completion tokens streamed so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    sent = chunks(None, [[5], [6, 7], [8]], whole=True, stream_options=options)
    assert [c["usage"]["completion_tokens"] for c in sent] == [1, 3, 4]
    assert {c["usage"]["prompt_tokens"] for c in sent} == {2}
    assert [c["usage"]["total_tokens"] for c in sent] == [3, 5, 6]
    plain = chunks(None, [[5], [6]], whole=True, stream_options={"include_usage": True})
    assert all("usage" not in c for c in plain)
