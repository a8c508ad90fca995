"""Reading an OpenAI request body before its fields are parsed: the JSON itself, and the
parameters that are known but not supported.

The rule (docs/serving.md, "OpenAI API parameters"): every parameter the API accepts takes effect,
and a known OpenAI or vLLM parameter that does not is refused with a 400 naming it, unless it
carries its default value. Unknown extra fields are ignored, as OpenAI and vLLM do.

A hostile body fails here with a 400, never deeper: JSON nested past `MAX_DEPTH`, the
non-JSON constants `NaN` / `Infinity` (Python's json accepts them), and strings with lone
UTF-16 surrogates (valid JSON escapes that no UTF-8 encoder takes).
"""

from __future__ import annotations

import json
from typing import Any

from hybridserve.cluster.openai.protocol import OpenAIError

MAX_DEPTH = 64

# Known parameters without an effect here, and the values that mean "not used". Parameters
# that take effect are fields of the request models (openai_protocol.py).
_REFUSED_COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": ((None, []), "bad_words is not supported; use logit_bias"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated; shorten the prompt"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the text"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported; send text or token ids"),
    "priority": ((0, None), "request priorities are not supported"),
    "kv_transfer_params": ((None,), "the service moves KV state itself"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "request_id": ((None,), "request ids are assigned by the server (the response id)"),
    "guided_decoding_backend": ((None,), "the structured-output backend is llguidance"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((None,), "structural tags are not supported"),
    "mm_processor_kwargs": ((None,), "multimodal inputs are not supported"),
    "metadata": ((None, {}), "stored completions are not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    # Reasoning parsers split the reasoning off; a budget would need the engine to end it.
    "thinking_token_budget": ((None,), "reasoning budgets are not supported"),
    # SGLang's.
    "no_stop_trim": ((None, False), "use include_stop_str_in_output"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "session_params": ((None,), "sessions are not supported; the prefix cache follows prompts"),
    "rid": ((None,), "request ids are assigned by the server (the response id)"),
    "return_hidden_states": ((None, False), "hidden states are not returned"),
    "bootstrap_host": ((None,), "the service moves KV state itself"),
    "bootstrap_port": ((None,), "the service moves KV state itself"),
    "bootstrap_room": ((None,), "the service moves KV state itself"),
    "custom_logit_processor": ((None,), "custom logits processors are not supported"),
    "custom_params": ((None,), "custom logits processors are not supported"),
}
# vLLM's structured_outputs fields that tune its backends; llguidance has its own defaults.
_REFUSED_STRUCTURED_OUTPUTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "disable_fallback": ((False, None), "there is one structured-output backend"),
    "disable_any_whitespace": ((False, None), "JSON output is always compact"),
    "disable_additional_properties": ((False, None), "schemas are applied as given"),
    "whitespace_pattern": ((None,), "JSON output is always compact"),
    "structural_tag": ((None,), "structural tags are not supported"),
}
_REFUSED_COMPLETIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported by these models"),
    "add_special_tokens": ((True,), "add_special_tokens=false is not supported"),
    "include_reasoning": ((None, True), "completions carry no separate reasoning"),
}
_REFUSED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "echo is supported on /v1/completions only"),
    "functions": ((None, []), "functions is deprecated; send tools"),
    "function_call": ((None, "none"), "function_call is deprecated; send tool_choice"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "add_generation_prompt": ((True,), "add_generation_prompt=false is not supported"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "documents": ((None, []), "documents are not supported"),
    "add_special_tokens": ((False,), "add_special_tokens=true is not supported for chat"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_key": ((None,), "the prompt cache is keyed by the prompt itself"),
    "prompt_cache_retention": ((None,), "the prompt cache's retention is the service's"),
    "prompt_cache_options": ((None,), "the prompt cache's options are the service's"),
    "verbosity": ((None, "medium"), "verbosity is not supported"),
    # SGLang's: reasoning is always separated where a reasoning parser is set.
    "separate_reasoning": ((None, True), "use include_reasoning"),
    "stream_reasoning": ((None, True), "reasoning always streams as it comes"),
}

# The Responses API's parameters without an effect here (what does take effect:
# responses_api.ResponsesRequest).
_REFUSED_RESPONSES: dict[str, tuple[tuple[Any, ...], str]] = {
    "include": ((None, []), "no extra output is included"),
    "background": ((None, False), "background responses are not supported"),
    "prompt": ((None,), "stored prompt templates are not supported; send the input"),
    "conversation": ((None,), "conversations are not stored; use previous_response_id"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported"),
    "prompt_cache_key": ((None,), "the prompt cache is keyed by the prompt itself"),
    "prompt_cache_retention": ((None,), "the prompt cache's retention is the service's"),
    "prompt_cache_options": ((None,), "the prompt cache's options are the service's"),
    "context_management": ((None,), "context management is not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not returned by /v1/responses; use chat"),
    "stream_options": ((None,), "stream_options is not supported by /v1/responses"),
    "moderation": ((None,), "moderation is not supported"),
    "image": ((None,), "image output is not supported"),
    "background_options": ((None,), "background responses are not supported"),
    "access_programs": ((None, []), "access programs are not supported"),
}

# Known parameters that identify the end user, for OpenAI's abuse monitoring: accepted, and
# without an effect on the answer (they are not logged either).
IDENTIFIERS = frozenset({"user", "safety_identifier"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 for anything else (see the module docstring)."""

    def refuse_constant(name: str) -> None:
        raise OpenAIError(400, f"the request body is not valid JSON: {name} is not a JSON value")

    try:
        data = json.loads(raw, parse_constant=refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(
            400, f"the request body is nested deeper than {MAX_DEPTH} levels"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _check_values(data)
    return data


def _check_values(data: dict[str, Any]) -> None:
    """Depth and lone surrogates, iteratively (a deep body must not recurse here either)."""
    pending: list[tuple[Any, str, int]] = [(data, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise OpenAIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path or "(key)")
                pending.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            pending.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(
            400,
            f"{path}: the string holds a lone UTF-16 surrogate ({exc.object[exc.start]!r} at "
            f"{exc.start}), which is not valid Unicode text",
            param=path or None,
        ) from None


def refused_parameters(endpoint: str) -> dict[str, tuple[tuple[Any, ...], str]]:
    """The known parameters `endpoint` ("completions", "chat" or "responses") refuses: name ->
    (the values that mean "not used", why)."""
    if endpoint == "responses":
        return _REFUSED_RESPONSES
    return _REFUSED_COMMON | (_REFUSED_CHAT if endpoint == "chat" else _REFUSED_COMPLETIONS)


def refuse_unsupported(data: dict[str, Any], endpoint: str) -> None:
    """A 400 naming the first known parameter that is set but has no effect on `endpoint`."""
    _refuse(data, refused_parameters(endpoint), "")
    nested = data.get("structured_outputs")
    if isinstance(nested, dict):
        _refuse(nested, _REFUSED_STRUCTURED_OUTPUTS, "structured_outputs.")


def _refuse(
    data: dict[str, Any], refused: dict[str, tuple[tuple[Any, ...], str]], prefix: str
) -> None:
    for name, (defaults, why) in refused.items():
        if name in data and not any(_same(data[name], d) for d in defaults):
            raise OpenAIError(400, f"{prefix}{name}: {why}.", param=prefix + name)


def _same(value: Any, default: Any) -> bool:
    # NOTE: by type too: 0 is not False, and 1 is accepted for 1.0.
    if isinstance(default, float) and type(value) is int:
        return value == default
    return type(value) is type(default) and value == default
