"""The OpenAI-compatible requests: request models, errors, sampling limits and cache salts.

Requests parse with pydantic: unknown fields are ignored as OpenAI does, but wrong types and
ranges raise, and `validation_error` turns that into the OpenAI 400 body. Once the prompt is
tokenized, `to_sampling_params` checks what only the engine's limits can decide (context length,
vocabulary) and builds the engine's `SamplingParams`. `derive_cache_salt` scopes the request's
`cache_salt` to its tenant. Response bodies live in `openai_responses`, the stop-string matcher
in `stop_strings`. No FastAPI or Ray import: the app adapts these to HTTP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hybridserve.workers.sampling_params import SamplingParams

MAX_STOP_SEQUENCES = 4

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
# OpenAI clients send fields we do not use (logprobs, presence_penalty, ...).
_REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extensions."""

    model_config = _REQUEST_CONFIG
    _prompt_param: ClassVar[str]

    model: str | None = Field(None, description="None = the served model")
    temperature: float | None = Field(None, ge=0.0, description="None = 1.0; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="-1 or 0 = no top-k filter (vLLM)")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = 1
    stop: list[str] = Field(default_factory=list, description="a string or up to 4 strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        # NOTE: many clients send `"stop": null` or `"n": null` for "not set", as OpenAI allows.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _at_least_one(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {value}.")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value > 1:
            raise ValueError("n>1 is not supported; send one request per choice.")
        if value < 1:
            raise ValueError(f"n must be 1, got {value}.")
        return value

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
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    _prompt_param: ClassVar[str] = "prompt"

    prompt: str | list[int]
    max_tokens: int = 16

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
        return self.max_tokens, "max_tokens"

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
    content: str = ""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if value is None:  # an assistant turn that only called tools
            return ""
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


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions; the output limit is `max_completion_tokens` or `max_tokens`."""

    _prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

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
