"""The OpenAI responses: bodies and stream chunks parse as OpenAI's types, SSE framing, models."""

from __future__ import annotations

import json

from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from hybridserve.cluster.openai.protocol import OpenAIError
from hybridserve.cluster.openai.response_body import (
    SSE_DONE,
    LogprobsFormatter,
    ResponseMeta,
    Usage,
    choice,
    models_list,
    response_body,
    sse_error,
    sse_event,
    stream_chunk,
    usage_chunk,
)
from hybridserve.workers.core.outputs import TokenLogprobs

# -- responses ----------------------------------------------------------------------------------


def test_completion_body_matches_openai_types():
    meta = ResponseMeta.new("tiny", chat=False)
    assert meta.id.startswith("cmpl-")
    choices = [choice(meta, 0, "hi there", "length")]
    body = response_body(meta, choices, Usage(5, 2, cached_tokens=4))
    assert body == {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": "tiny",
        "choices": [{"index": 0, "text": "hi there", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    parsed = Completion.model_validate(body)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_body_matches_openai_types():
    meta = ResponseMeta.new("tiny", chat=True)
    assert meta.id.startswith("chatcmpl-")
    body = response_body(meta, [choice(meta, 0, "hello", "stop")], Usage(3, 1))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hello"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hello"
    assert parsed.usage.total_tokens == 4


def test_choices_are_ordered_by_index():
    meta = ResponseMeta("cmpl-1", "tiny", 0, chat=False)
    choices = [choice(meta, i, str(i), "stop") for i in (2, 0, 1)]
    body = response_body(meta, choices, Usage(1, 3))
    assert [c["text"] for c in body["choices"]] == ["0", "1", "2"]
    assert [c.index for c in Completion.model_validate(body).choices] == [0, 1, 2]


def test_token_ids_use_vllm_layout():
    meta = ResponseMeta("cmpl-1", "tiny", 0, chat=False)
    one = choice(meta, 0, "ab", "stop", token_ids=[97, 98], prompt_token_ids=(1, 2))
    completion = response_body(meta, [one], Usage(2, 2), prompt_token_ids=(1, 2))
    assert completion["choices"][0]["token_ids"] == [97, 98]
    assert completion["choices"][0]["prompt_token_ids"] == [1, 2]
    assert "prompt_token_ids" not in completion
    meta = ResponseMeta("chatcmpl-1", "tiny", 0, chat=True)
    one = choice(meta, 0, "ab", "stop", token_ids=[97, 98], prompt_token_ids=[1, 2])
    chat = response_body(meta, [one], Usage(2, 2), prompt_token_ids=[1, 2])
    assert chat["prompt_token_ids"] == [1, 2]
    assert chat["choices"][0]["token_ids"] == [97, 98]
    assert "prompt_token_ids" not in chat["choices"][0]
    Completion.model_validate(completion)
    ChatCompletion.model_validate(chat)


def test_chat_stream_chunks():
    meta = ResponseMeta("chatcmpl-1", "tiny", 123, chat=True)
    first = stream_chunk(
        meta, choice(meta, 0, "", None, stream=True, first=True, token_ids=[]), [1]
    )
    middle = stream_chunk(meta, choice(meta, 0, "Hel", None, stream=True, token_ids=[5]))
    last = stream_chunk(meta, choice(meta, 0, "lo", "stop", stream=True, token_ids=[6]))
    usage = usage_chunk(meta, Usage(1, 2))
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "tiny",
        "prompt_token_ids": [1],
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [],
            }
        ],
    }
    assert middle["choices"][0]["delta"] == {"content": "Hel"}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert usage == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "tiny",
        "choices": [],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    chunks = [ChatCompletionChunk.model_validate(c) for c in (first, middle, last, usage)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks[:3]) == "Hello"
    assert chunks[3].usage.completion_tokens == 2


def test_completion_stream_chunks():
    meta = ResponseMeta("cmpl-1", "tiny", 123, chat=False)
    middle = stream_chunk(meta, choice(meta, 1, "Hel", None, stream=True, first=True))
    last = stream_chunk(meta, choice(meta, 1, "lo", "length", stream=True))
    assert middle == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [{"index": 1, "text": "Hel", "logprobs": None, "finish_reason": None}],
    }
    # NOTE: OpenAI's `Completion` type requires a finish_reason, so only the last chunk parses
    # strictly (the client itself reads stream chunks without validation).
    assert Completion.model_validate(last).choices[0].text == "lo"
    usage = usage_chunk(meta, Usage(1, 2, cached_tokens=1))
    assert (usage["object"], usage["choices"]) == ("text_completion", [])
    assert Completion.model_validate(usage).usage.prompt_tokens_details.cached_tokens == 1


class _Tokenizer:
    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t) for t in token_ids)


def test_completion_logprobs_are_parallel_lists_with_text_offsets():
    formatter = LogprobsFormatter(_Tokenizer())
    entries = [None, TokenLogprobs(1, -0.5, ((1, -0.5), (2, -1.5))), TokenLogprobs(0, -2.0, ())]
    body = formatter.completion([0, 1, 0], entries, text_offset=3)
    assert body == {
        "tokens": ["a", "b", "a"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"b": -0.5, "c": -1.5}, {}],
        "text_offset": [3, 4, 5],
    }
    # NOTE: the echoed first prompt token's null (as OpenAI and vLLM send it) is outside
    # OpenAI's strict type, which the client does not apply; the rest parses.
    meta = ResponseMeta("cmpl-1", "tiny", 0, chat=False)
    generated = formatter.completion([1, 0], entries[1:])
    parsed = Completion.model_validate(
        response_body(meta, [choice(meta, 0, "ba", "length", logprobs=generated)], Usage(1, 2))
    )
    assert parsed.choices[0].logprobs.token_logprobs == [-0.5, -2.0]


def test_chat_logprobs_use_openai_content_entries():
    formatter = LogprobsFormatter(_Tokenizer())
    body = formatter.chat([TokenLogprobs(2, -0.25, ((2, -0.25), (0, -3.0)))])
    assert body == {
        "content": [
            {
                "token": "c",
                "logprob": -0.25,
                "bytes": [99],
                "top_logprobs": [
                    {"token": "c", "logprob": -0.25, "bytes": [99]},
                    {"token": "a", "logprob": -3.0, "bytes": [97]},
                ],
            }
        ]
    }
    meta = ResponseMeta("chatcmpl-1", "tiny", 0, chat=True)
    parsed = ChatCompletion.model_validate(
        response_body(meta, [choice(meta, 0, "c", "length", logprobs=body)], Usage(1, 1))
    )
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "a"
    as_ids = LogprobsFormatter(_Tokenizer(), as_token_ids=True)
    assert as_ids.chat([TokenLogprobs(2, -0.25, ())])["content"][0]["token"] == "token_id:2"


def test_sse_encoding():
    assert sse_event({"text": "é", "n": [1, 2]}) == 'data: {"text":"é","n":[1,2]}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    event = sse_error(OpenAIError(500, "engine died", code="engine_error"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("data: ")) == {
        "error": {
            "message": "engine died",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }


def test_models_list():
    body = models_list(["tiny", "tiny-2"], created=7)
    assert body == {
        "object": "list",
        "data": [
            {"id": "tiny", "object": "model", "created": 7, "owned_by": "hybridserve"},
            {"id": "tiny-2", "object": "model", "created": 7, "owned_by": "hybridserve"},
        ],
    }
    assert [Model.model_validate(m).id for m in body["data"]] == ["tiny", "tiny-2"]
