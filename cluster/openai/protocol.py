"""The OpenAI-compatible requests: request models, errors, sampling limits and cache salts.

Requests parse with pydantic: unknown fields are ignored as OpenAI does, but wrong types and
ranges raise, and `validation_error` turns that into the OpenAI 400 body (known parameters
without an effect are refused before, in `openai_body`). Once the prompt is tokenized,
`to_sampling_params` checks what only the engine's limits can decide (context length,
vocabulary) and builds the engine's `SamplingParams`. `derive_cache_salt` scopes the request's
`cache_salt` to its tenant. Response bodies live in `openai_responses`, the stop-string matcher
in `stop_strings`. No FastAPI or Ray import: the app adapts these to HTTP.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hybridserve.workers.core.sampling_params import SamplingParams, StructuredOutput

MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 20  # per token, as vLLM's default max_logprobs
MAX_CHOICES = 128

# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    """An error the client receives as `{"error": {message, type, param, code}}` with `status`.

    `retry_after_s` (429/503) becomes a `Retry-After` header through `headers()`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        assert status in _ERROR_TYPES, f"unsupported error status {status}"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES[status]
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def _param_name(loc: Sequence[int | str]) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name or None


def validation_error(exc: ValidationError) -> OpenAIError:
    """The 400 for a request that failed to parse: the first problem, naming its field."""
    first = exc.errors(include_url=False)[0]
    param = _param_name(first["loc"])
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if first["type"] == "value_error":
        message = str(first["ctx"]["error"])  # our own checks already name the field
        if param is None:  # a check across fields: its message starts with the one at fault
            named = re.match(r"([a-z_]+)\b", message)
            param = named.group(1) if named else None
    return OpenAIError(400, message, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist. GET /v1/models lists the served models.",
        param="model",
        code="model_not_found",
    )


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------

# NOTE: strict, so "0.5" is not a temperature and true is not a token id; extra="ignore" because
# clients send fields of newer API versions; the known ones without an effect are refused in
# openai_body.
_REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore", frozen=True)


class JsonSchemaFormat(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str = "response"
    description: str | None = None
    # NOTE: not strict: a JSON Schema is any JSON object.
    schema_: dict[str, Any] = Field(alias="schema", default_factory=dict)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text (no constraint), any JSON object, or a JSON Schema."""

    model_config = _REQUEST_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object.")
        return self


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (GuideLLM asks for it).
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extensions."""

    model_config = _REQUEST_CONFIG
    _prompt_param: ClassVar[str]

    model: str | None = Field(None, description="None = the served model")
    temperature: float | None = Field(None, ge=0.0, description="None = 1.0; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="-1 or 0 = no top-k filter (vLLM)")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    # NOTE: JSON object keys are strings: token ids as text ("50256": -100).
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    stop: list[str] = Field(default_factory=list, description="a string or up to 4 strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # Extensions (vLLM names).
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        # NOTE: many clients send `"stop": null` or `"n": null` for "not set", as OpenAI allows.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _best_of_is_n(self) -> _GenerationRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of ({self.best_of}) other than n ({self.n}) is not supported: every "
                "choice generated is returned."
            )
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"top_k must be -1 or 0 (no filter) or at least 1, got {value}.")
        return None if value in (-1, 0) else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(
                    f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}."
                )
            if "" in value:
                raise ValueError("stop sequences must not be empty strings.")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        if value == "":
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (ignored without `stream`)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every stream chunk carries the usage so far (vLLM's
        `continuous_usage_stats`, with `include_usage`)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def structured_output(self) -> StructuredOutput | None:
        constraint = self.output_constraint()
        return None if constraint is None else constraint[1]

    def output_constraint(self) -> tuple[str, StructuredOutput] | None:
        """The output constraint and the parameter that gave it, from response_format or
        vLLM's guided_* (one at most)."""
        given: list[tuple[str, StructuredOutput]] = []
        form = self.response_format
        if form is not None and form.type == "json_object":
            given.append(("response_format", StructuredOutput(kind="json")))
        elif form is not None and form.type == "json_schema":
            assert form.json_schema is not None
            schema = json.dumps(form.json_schema.schema_)
            given.append(("response_format", StructuredOutput(kind="json_schema", spec=schema)))
        if self.guided_json is not None:
            spec = self.guided_json
            text = spec if isinstance(spec, str) else json.dumps(spec)
            given.append(("guided_json", StructuredOutput(kind="json_schema", spec=text)))
        if self.guided_regex is not None:
            given.append(("guided_regex", StructuredOutput(kind="regex", spec=self.guided_regex)))
        if self.guided_choice is not None:
            choices = json.dumps(self.guided_choice)
            given.append(("guided_choice", StructuredOutput(kind="choice", spec=choices)))
        if self.guided_grammar is not None:
            grammar = self.guided_grammar
            given.append(("guided_grammar", StructuredOutput(kind="grammar", spec=grammar)))
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise OpenAIError(
                400, f"give one output constraint, not several ({names}).", param=given[1][0]
            )
        return given[0] if given else None

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            token_id = int(key) if key.lstrip("-").isdigit() else None
            if token_id is None or not 0 <= token_id < vocab_size:
                raise OpenAIError(
                    400,
                    f"logit_bias key {key!r} is not a token id of the vocabulary [0, "
                    f"{vocab_size}).",
                    param="logit_bias",
                )
            if not -100.0 <= bias <= 100.0:
                raise OpenAIError(
                    400,
                    f"logit_bias for token {token_id} is {bias}; biases lie in [-100, 100].",
                    param="logit_bias",
                )
            pairs.append((token_id, float(bias)))
        return tuple(pairs)

    def _logprobs(self) -> int | None:
        """How many top logprobs per generated token (None: none at all)."""
        raise NotImplementedError

    @property
    def scoring_only(self) -> bool:
        """A request that only scores its prompt (completions echo with max_tokens 0)."""
        return False

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        """(the client's output limit or None, the field name it came in)."""
        raise NotImplementedError

    def to_sampling_params(
        self, vocab_size: int, max_model_len: int, prompt_len: int
    ) -> SamplingParams:
        """The engine's parameters; raises a 400 `OpenAIError` for anything the engine rejects.

        `prompt_len` counts the tokenized prompt (after the chat template). Without a limit from
        the client, the output may fill the context: `max(1, max_model_len - prompt_len)`.
        """
        if prompt_len < 1:
            raise OpenAIError(
                400, "The prompt is empty; send at least one token.", param=self._prompt_param
            )
        requested, max_tokens_param = self._requested_max_tokens()
        max_tokens = requested if requested is not None else max(1, max_model_len - prompt_len)
        if prompt_len + max_tokens > max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                param=self._prompt_param,
                code="context_length_exceeded",
            )
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise OpenAIError(
                    400,
                    f"stop_token_ids contains {token_id}, which is outside the vocabulary "
                    f"[0, {vocab_size}).",
                    param="stop_token_ids",
                )
        if self.min_tokens > max_tokens:
            raise OpenAIError(
                400,
                f"min_tokens ({self.min_tokens}) must not exceed {max_tokens_param} "
                f"({max_tokens}).",
                param="min_tokens",
            )
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_pairs(vocab_size),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            structured_output=self.structured_output(),
        )

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    _prompt_param: ClassVar[str] = "prompt"

    prompt: str | list[int]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _zero_tokens_only_to_score(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens must be at least 1, got 0 (0 is for scoring a prompt with echo)."
            )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # OpenAI also takes a batch (a list of strings or of token-id lists); we take one prompt.
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) > 1:
                raise ValueError(
                    f"prompt holds {len(value)} prompts, but batched prompts are not supported; "
                    "send one prompt per request."
                )
            value = value[0]
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("prompt must be a string or a list of token ids.")
        if not value:
            raise ValueError("prompt must not be an empty list.")
        for position, token_id in enumerate(value):
            if type(token_id) is not int:
                raise ValueError(
                    f"prompt token ids must be integers, got {token_id!r} at position {position}."
                )
        return value

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        # Scoring (echo, max_tokens 0): the engine generates one token, which is not returned.
        return max(self.max_tokens, 1), "max_tokens"

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs returns the prompt's tokens with their logprobs too.
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def scoring_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def to_sampling_params(
        self, vocab_size: int, max_model_len: int, prompt_len: int
    ) -> SamplingParams:
        # NOTE: an out-of-vocabulary id would index past the embedding table
        # (docs/failure-handling.md).
        if isinstance(self.prompt, list):
            for token_id in self.prompt:
                if not 0 <= token_id < vocab_size:
                    raise OpenAIError(
                        400,
                        f"prompt contains token id {token_id}, which is outside the vocabulary "
                        f"[0, {vocab_size}).",
                        param="prompt",
                    )
        return super().to_sampling_params(vocab_size, max_model_len, prompt_len)


class ChatMessage(BaseModel):
    """One chat turn; `content` is text, or text parts joined with newlines (as vLLM does)."""

    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    # NOTE: validated when absent too, so a message without content is refused by name.
    content: str = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("content is required: every message carries text.")
        if not isinstance(value, list):
            return value
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"content part {index} has type {kind!r}, but only text parts "
                    "({'type': 'text', 'text': ...}) are supported."
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index} needs a string 'text'.")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("assistant tool_calls are not supported (tool calling is off).")
        return value


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions; the output limit is `max_completion_tokens` or `max_tokens`."""

    _prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        if self.tools:
            raise ValueError(
                "tools: tool calling is not supported by this server (the built-in parsers "
                "cover no tool format yet); send the request without tools."
            )
        if self.tool_choice not in (None, "none"):
            raise ValueError(
                f"tool_choice {self.tool_choice!r} needs tools, which are not supported."
            )
        return self

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template takes it: [{"role", "content"}]."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


# ----------------------------------------------------------------------------------------------
# Tenant isolation
# ----------------------------------------------------------------------------------------------


def derive_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The prefix-cache salt for a request: SHA-256 over length-prefixed, tagged parts.

    The server-derived `tenant` (e.g. from the API key) comes first, so a client's own salt only
    narrows sharing inside its tenant and can never reproduce another tenant's salt. Each part
    carries a presence flag and its byte length, so ("org_1", "2345") and ("org_12345", "")
    differ (naive concatenation collides). None when there is neither.
    """
    if tenant is None and client_salt is None:
        return None
    digest = hashlib.sha256(b"hybridserve/cache-salt/v1\x00")
    for tag, part in ((b"tenant", tenant), (b"client", client_salt)):
        digest.update(tag)
        if part is None:
            digest.update(b"\x00")
        else:
            encoded = part.encode()
            digest.update(b"\x01" + len(encoded).to_bytes(8, "big") + encoded)
    return digest.hexdigest()
