"""The OpenAI requests: parsing and errors, sampling limits, cache salts."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from hybridserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_token_ids,
    derive_cache_salt,
    model_not_found,
    validation_error,
)
from hybridserve.workers.core.sampling_params import SamplingParams

USER = [{"role": "user", "content": "hi"}]


def parse_error(cls, body) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return validation_error(info.value)


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        ([1, 2], [[1, 2]]),
        (["hello"], ["hello"]),
        ([[1, 2]], [[1, 2]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    """OpenAI's four prompt shapes, as a list of prompts (a batch runs each)."""
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


def test_defaults_and_ignored_fields():
    request = CompletionRequest.model_validate(
        {"prompt": "a", "logprobs": None, "presence_penalty": 0.5, "stop": None, "n": None}
    )
    assert request.max_tokens == 16
    assert (request.n, request.stop, request.stream, request.include_usage) == (1, [], False, False)
    chat = ChatCompletionRequest.model_validate({"messages": USER, "frequency_penalty": 1})
    assert (chat.model, chat.max_tokens, chat.max_completion_tokens) == (None, None, None)


def test_stop_forms_and_top_k_disable():
    request = CompletionRequest.model_validate({"prompt": "a", "stop": "\n", "top_k": -1})
    assert (request.stop, request.top_k) == (["\n"], None)
    assert CompletionRequest.model_validate({"prompt": "a", "top_k": 0}).top_k is None


def test_include_usage_needs_stream():
    body = {"prompt": "a", "stream_options": {"include_usage": True}}
    assert not CompletionRequest.model_validate(body).include_usage
    assert CompletionRequest.model_validate({**body, "stream": True}).include_usage


def test_chat_content_parts_join_with_newlines():
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": content},
        {"role": "assistant", "content": "ok"},
    ]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    assert request.template_messages() == [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("cls", "body", "param", "message"),
    [
        (CompletionRequest, {"prompt": "a", "max_tokens": -3}, "max_tokens",
         "max_tokens: Input should be greater than or equal to 0"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 0}, "max_tokens",
         "max_tokens must be at least 1, got 0 (0 is for scoring a prompt with echo)."),
        (ChatCompletionRequest, {"messages": USER, "max_completion_tokens": 0},
         "max_completion_tokens",
         "max_completion_tokens: Input should be greater than or equal to 1"),
        (CompletionRequest, {"prompt": "a", "n": 200}, "n",
         "n: Input should be less than or equal to 128"),
        (CompletionRequest, {"prompt": "a", "n": 2, "best_of": 3}, "best_of",
         "best_of (3) other than n (2) is not supported: every choice generated is returned."),
        (CompletionRequest, {"prompt": "a", "logprobs": 21}, "logprobs",
         "logprobs: Input should be less than or equal to 20"),
        (CompletionRequest, {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty",
         "presence_penalty: Input should be less than or equal to 2"),
        (ChatCompletionRequest, {"messages": USER, "top_logprobs": 3}, "top_logprobs",
         "top_logprobs needs logprobs=true."),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages[0].content",
         "content is required: every message carries text."),
        (ChatCompletionRequest, {"messages": [{"role": "assistant", "content": None}]},
         "messages[0].content", "content is required: every message carries text."),
        (ChatCompletionRequest,
         {"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]},
         "messages[0].tool_calls[0].id", "messages[0].tool_calls[0].id: Field required"),
        (ChatCompletionRequest,
         {"messages": [{"role": "user", "content": "a", "tool_calls": []}]},
         "messages[0].tool_calls", "tool_calls: only assistant messages carry them, not user."),
        (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "a"}]},
         "messages[0].tool_call_id", "tool_call_id: a tool message names the call it answers."),
        (ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function"}]},
         "tools[0].function", "tools[0].function: Field required"),
        (ChatCompletionRequest, {"messages": USER, "tool_choice": "required"}, "tool_choice",
         "tool_choice 'required' needs tools."),
        (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "json_schema"}},
         "response_format", "response_format of type json_schema needs a json_schema object."),
        (CompletionRequest, {"prompt": ["a"] * 257}, "prompt",
         "prompt holds 257 prompts; at most 256 per request."),
        (CompletionRequest, {"prompt": ["a", []]}, "prompt",
         "prompt 1 must be a string or a non-empty list of token ids."),
        (CompletionRequest, {"prompt": []}, "prompt",
         "prompt must be a string, a list of token ids, or a list of those."),
        (CompletionRequest, {"prompt": [1, True]}, "prompt",
         "prompt: token ids must be integers, got True at position 1."),
        (CompletionRequest, {"prompt": 5}, "prompt",
         "prompt must be a string, a list of token ids, or a list of those."),
        (CompletionRequest, {}, "prompt", "prompt: Field required"),
        (CompletionRequest, {"prompt": "a", "temperature": -0.5}, "temperature",
         "temperature: Input should be greater than or equal to 0"),
        (CompletionRequest, {"prompt": "a", "temperature": "0.5"}, "temperature",
         "temperature: Input should be a valid number"),
        (CompletionRequest, {"prompt": "a", "top_p": 0}, "top_p",
         "top_p: Input should be greater than 0"),
        (CompletionRequest, {"prompt": "a", "top_k": -2}, "top_k",
         "top_k must be -1 or 0 (no filter) or at least 1, got -2."),
        (CompletionRequest, {"prompt": "a", "min_tokens": -1}, "min_tokens",
         "min_tokens: Input should be greater than or equal to 0"),
        (CompletionRequest, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop",
         "stop accepts at most 4 sequences, got 5."),
        (CompletionRequest, {"prompt": "a", "stop": ["a", 3]}, "stop[1]",
         "stop[1]: Input should be a valid string"),
        (CompletionRequest, {"prompt": "a", "stop": [""]}, "stop",
         "stop sequences must not be empty strings."),
        (CompletionRequest, {"prompt": "a", "stream": "yes"}, "stream",
         "stream: Input should be a valid boolean"),
        (CompletionRequest, {"prompt": "a", "cache_salt": ""}, "cache_salt",
         "Parameter 'cache_salt' must be a non-empty string if provided."),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": [1, "2"]}, "stop_token_ids[1]",
         "stop_token_ids[1]: Input should be a valid integer"),
        (ChatCompletionRequest, {"messages": []}, "messages",
         "messages: List should have at least 1 item after validation, not 0"),
        (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role",
         "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
        (ChatCompletionRequest,
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content",
         "content part 0 has type 'image_url', but only text parts ({'type': 'text', 'text': "
         "...}) are supported."),
        # An image-text checkpoint (Qwen3.5) is served as text: its media parts are refused too.
        (ChatCompletionRequest,
         {"messages": [{"role": "user", "content": [
             {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}]}]},
         "messages[0].content",
         "content part 1 has type 'input_audio', but only text parts ({'type': 'text', 'text': "
         "...}) are supported."),
    ],
)  # fmt: skip
def test_invalid_requests_are_400_naming_the_field(cls, body, param, message):
    error = parse_error(cls, body)
    assert (error.status, error.param, error.message) == (400, param, message)
    assert error.body() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_body_that_is_not_an_object():
    error = parse_error(CompletionRequest, [1])
    assert error.param is None
    assert error.message == "Input should be a valid dictionary or instance of CompletionRequest"


# -- sampling parameters ------------------------------------------------------------------------


def test_to_sampling_params_maps_every_field():
    request = CompletionRequest.model_validate(
        {
            "prompt": [1, 2, 3],
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 11,
            "stop_token_ids": [0, 99],
            "ignore_eos": True,
            "min_tokens": 2,
        }
    )
    assert request.to_sampling_params(vocab_size=100, max_model_len=64, prompt_len=3) == (
        SamplingParams(
            max_tokens=7,
            temperature=0.0,
            top_p=0.9,
            top_k=5,
            seed=11,
            stop_token_ids=(0, 99),
            ignore_eos=True,
            min_tokens=2,
        )
    )
    defaults = CompletionRequest.model_validate({"prompt": "a"})
    assert defaults.to_sampling_params(100, 64, 1) == SamplingParams(max_tokens=16)


def test_chat_max_tokens_names_and_default():
    def max_tokens(body, prompt_len=10):
        request = ChatCompletionRequest.model_validate({"messages": USER, **body})
        return request.to_sampling_params(100, 64, prompt_len).max_tokens

    assert max_tokens({}) == 54  # max_model_len - prompt_len
    assert max_tokens({}, prompt_len=63) == 1
    assert max_tokens({"max_tokens": 5}) == 5
    assert max_tokens({"max_completion_tokens": 6, "max_tokens": 5}) == 6


@pytest.mark.parametrize(
    ("cls", "body", "prompt_len", "message"),
    [
        (CompletionRequest, {"prompt": "a", "max_tokens": 20}, 50,
         "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
         "(50 in the messages, 20 in the completion). Please reduce the length of the messages "
         "or completion."),
        (ChatCompletionRequest, {"messages": USER}, 64,
         "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
         "(64 in the messages, 1 in the completion). Please reduce the length of the messages "
         "or completion."),
        (ChatCompletionRequest, {"messages": USER, "max_completion_tokens": 60}, 10,
         "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
         "(10 in the messages, 60 in the completion). Please reduce the length of the messages "
         "or completion."),
    ],
)  # fmt: skip
def test_context_length_exceeded(cls, body, prompt_len, message):
    request = cls.model_validate(body)
    with pytest.raises(OpenAIError) as info:
        request.to_sampling_params(vocab_size=100, max_model_len=64, prompt_len=prompt_len)
    assert (info.value.status, info.value.message) == (400, message)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == ("messages" if cls is ChatCompletionRequest else "prompt")


def test_prompt_that_exactly_fills_the_context_is_accepted():
    request = CompletionRequest.model_validate({"prompt": "a", "max_tokens": 14})
    assert request.to_sampling_params(100, 64, 50).max_tokens == 14


@pytest.mark.parametrize(
    ("body", "prompt_len", "param", "message"),
    [
        ({"prompt": "a", "stop_token_ids": [5, 100]}, 1, "stop_token_ids",
         "stop_token_ids contains 100, which is outside the vocabulary [0, 100)."),
        ({"prompt": "a", "stop_token_ids": [-1]}, 1, "stop_token_ids",
         "stop_token_ids contains -1, which is outside the vocabulary [0, 100)."),
        ({"prompt": "a", "min_tokens": 20}, 1, "min_tokens",
         "min_tokens (20) must not exceed max_tokens (16)."),
        ({"prompt": ""}, 0, "prompt", "The prompt is empty; send at least one token."),
    ],
)  # fmt: skip
def test_engine_limits_are_400(body, prompt_len, param, message):
    request = CompletionRequest.model_validate(body)
    with pytest.raises(OpenAIError) as info:
        request.to_sampling_params(vocab_size=100, max_model_len=64, prompt_len=prompt_len)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


@pytest.mark.parametrize("token_id", [100, -5])
def test_prompt_token_ids_outside_the_vocabulary_are_400(token_id):
    with pytest.raises(OpenAIError) as info:
        check_token_ids([3, token_id, 4], 100, "prompt")
    assert (info.value.status, info.value.param, info.value.message) == (
        400,
        "prompt",
        f"prompt contains token id {token_id}, which is outside the vocabulary [0, 100).",
    )


def test_min_tokens_message_names_the_limit_the_client_used():
    request = ChatCompletionRequest.model_validate(
        {"messages": USER, "max_completion_tokens": 3, "min_tokens": 4}
    )
    with pytest.raises(OpenAIError, match=r"^min_tokens \(4\) must not exceed "
                       r"max_completion_tokens \(3\)\.$"):  # fmt: skip
        request.to_sampling_params(100, 64, 5)


# -- errors -------------------------------------------------------------------------------------


def test_error_types_and_headers():
    busy = OpenAIError(503, "Overloaded; retry shortly.", retry_after_s=2)
    assert busy.body()["error"]["type"] == "service_unavailable_error"
    assert busy.headers() == {"Retry-After": "2"}
    denied = OpenAIError(401, "Invalid API key.", code="invalid_api_key")
    assert (denied.type, denied.headers()) == ("authentication_error", {})
    assert model_not_found("gpt-x").body() == {
        "error": {
            "message": "The model `gpt-x` does not exist. GET /v1/models lists the served models.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# -- cache salts --------------------------------------------------------------------------------


def test_salt_concatenation_does_not_collide():
    assert derive_cache_salt("org_1", "2345") != derive_cache_salt("org_12345", "")
    assert derive_cache_salt("org_12345", "") != derive_cache_salt("org_12345", None)
    assert derive_cache_salt("", None) != derive_cache_salt(None, "")


def test_client_salt_cannot_reach_another_tenants_salt():
    victim = derive_cache_salt("tenant-a", None)
    assert derive_cache_salt("tenant-b", victim) != victim
    assert derive_cache_salt(None, victim) != victim
    assert derive_cache_salt(None, "tenant-a") != victim


def test_salt_is_deterministic_and_pinned():
    assert derive_cache_salt(None, None) is None
    # Pinned: changing the construction silently splits every tenant's cache.
    assert derive_cache_salt("org_1", "2345") == (
        "37f794ef9ae5bbc1259c30b24901dd15d8a284a6110c42c0d826f20732ec2784"
    )
    manual = hashlib.sha256(
        b"hybridserve/cache-salt/v1\x00"
        + b"tenant\x01" + (5).to_bytes(8, "big") + b"org_1"
        + b"client\x01" + (4).to_bytes(8, "big") + b"2345"
    ).hexdigest()  # fmt: skip
    assert manual == derive_cache_salt("org_1", "2345")
    assert (
        derive_cache_salt(None, "x")
        == hashlib.sha256(
            b"hybridserve/cache-salt/v1\x00tenant\x00client\x01" + (1).to_bytes(8, "big") + b"x"
        ).hexdigest()
    )
