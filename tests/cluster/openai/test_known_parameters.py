"""No parameter passes silently: every parameter the `openai` SDK, vLLM or SGLang knows for an
endpoint is read by the request model (it takes effect) or refused with a 400 naming it.

The SDK's parameters are read from its request types, so an SDK upgrade that adds one fails
this test until the new parameter is served or refused. vLLM's and SGLang's extra fields are
listed below (their request models, vLLM 0.11 and SGLang 0.5); neither is installed here."""

from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from hybridserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from hybridserve.cluster.openai.request_body import (
    IDENTIFIERS,
    refuse_unsupported,
    refused_parameters,
)
from hybridserve.cluster.openai.responses_api import ResponsesRequest

VLLM_SAMPLING = {
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "priority",
    "request_id",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "response_format",
    "seed",
    "add_special_tokens",
    "thinking_token_budget",
    "mm_processor_kwargs",
}
VLLM = {
    "completions": VLLM_SAMPLING | {"echo", "prompt_embeds", "include_reasoning"},
    "chat": VLLM_SAMPLING
    | {
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "include_reasoning",
        "reasoning_effort",
        "parallel_tool_calls",
    },
    "responses": set(),
}
SGLANG_SAMPLING = {
    "top_k",
    "min_p",
    "min_tokens",
    "regex",
    "ebnf",
    "json_schema",
    "repetition_penalty",
    "stop_token_ids",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "lora_path",
    "session_params",
    "rid",
    "return_hidden_states",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "custom_logit_processor",
    "custom_params",
}
SGLANG = {
    "completions": SGLANG_SAMPLING,
    "chat": SGLANG_SAMPLING
    | {"continue_final_message", "separate_reasoning", "stream_reasoning", "chat_template_kwargs"},
    "responses": set(),
}  # fmt: skip
SDK_TYPES = {
    "completions": completion_create_params.CompletionCreateParamsBase,
    "chat": chat_create_params.CompletionCreateParamsBase,
    "responses": response_create_params.ResponseCreateParamsBase,
}
MODELS = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "responses": ResponsesRequest,
}


def known(endpoint: str) -> set[str]:
    sdk = set(typing.get_type_hints(SDK_TYPES[endpoint]))
    return sdk | {"stream"} | VLLM[endpoint] | SGLANG[endpoint]


def read(endpoint: str) -> set[str]:
    """The parameters the request model reads (by name or alias)."""
    fields = MODELS[endpoint].model_fields
    return set(fields) | {f.alias for f in fields.values() if f.alias}


@pytest.mark.parametrize("endpoint", MODELS)
def test_every_known_parameter_is_read_or_refused(endpoint):
    refused = set(refused_parameters(endpoint))
    served = read(endpoint)
    assert not served & refused, "a parameter is both read and refused"
    silent = known(endpoint) - served - refused - IDENTIFIERS
    assert not silent, f"/{endpoint}: neither read nor refused: {sorted(silent)}"


@pytest.mark.parametrize("endpoint", MODELS)
def test_each_refused_parameter_is_a_400_naming_it_when_set(endpoint):
    for name, (defaults, _) in refused_parameters(endpoint).items():
        for default in defaults:  # "not used" values pass
            refuse_unsupported({name: default}, endpoint)
        with pytest.raises(OpenAIError) as error:
            refuse_unsupported({name: object()}, endpoint)
        assert (error.value.status, error.value.param) == (400, name)
        assert error.value.message.startswith(f"{name}: ")
