"""The OpenAI responses: bodies and stream chunks parse as OpenAI's types, SSE framing, models."""

from __future__ import annotations

import json

from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from hybridserve.cluster.openai_protocol import OpenAIError
from hybridserve.cluster.openai_responses import (
    SSE_DONE,
    ResponseMeta,
    Usage,
    models_list,
    response_body,
    sse_error,
    sse_event,
    stream_chunk,
    usage_chunk,
)

# -- responses ----------------------------------------------------------------------------------


def test_completion_body_matches_openai_types():
    meta = ResponseMeta.new("tiny", chat=False)
    assert meta.id.startswith("cmpl-")
    body = response_body(meta, "hi there", "length", Usage(5, 2, cached_tokens=4))
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
    body = response_body(meta, "hello", "stop", Usage(3, 1))
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


def test_token_ids_use_vllm_layout():
    completion = response_body(
        ResponseMeta("cmpl-1", "tiny", 0, chat=False),
        "ab",
        "stop",
        Usage(2, 2),
        token_ids=[97, 98],
        prompt_token_ids=(1, 2),
    )
    assert completion["choices"][0]["token_ids"] == [97, 98]
    assert completion["choices"][0]["prompt_token_ids"] == [1, 2]
    chat = response_body(
        ResponseMeta("chatcmpl-1", "tiny", 0, chat=True),
        "ab",
        "stop",
        Usage(2, 2),
        token_ids=[97, 98],
        prompt_token_ids=[1, 2],
    )
    assert chat["prompt_token_ids"] == [1, 2]
    assert chat["choices"][0]["token_ids"] == [97, 98]
    assert "prompt_token_ids" not in chat["choices"][0]
    Completion.model_validate(completion)
    ChatCompletion.model_validate(chat)


def test_chat_stream_chunks():
    meta = ResponseMeta("chatcmpl-1", "tiny", 123, chat=True)
    first = stream_chunk(meta, "", first=True, prompt_token_ids=[1], token_ids=[])
    middle = stream_chunk(meta, "Hel", token_ids=[5])
    last = stream_chunk(meta, "lo", "stop", token_ids=[6])
    usage = usage_chunk(meta, Usage(1, 2))
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [],
            }
        ],
        "prompt_token_ids": [1],
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
    middle = stream_chunk(meta, "Hel", first=True)
    last = stream_chunk(meta, "lo", "length")
    assert middle == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}],
    }
    # NOTE: OpenAI's `Completion` type requires a finish_reason, so only the last chunk parses
    # strictly (the client itself reads stream chunks without validation).
    assert Completion.model_validate(last).choices[0].text == "lo"
    usage = usage_chunk(meta, Usage(1, 2, cached_tokens=1))
    assert (usage["object"], usage["choices"]) == ("text_completion", [])
    assert Completion.model_validate(usage).usage.prompt_tokens_details.cached_tokens == 1


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
