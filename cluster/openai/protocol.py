"""The OpenAI-compatible requests: request models, errors, sampling limits and cache salts.

Requests parse with pydantic: unknown fields are ignored as OpenAI does, but wrong types and
ranges raise, and `validation_error` turns that into the OpenAI 400 body (known parameters
without an effect are refused before, in `openai_body`). Once the prompt is tokenized,
`to_sampling_params` checks what only the engine's limits can decide (context length,
vocabulary) and builds the engine's `SamplingParams`. `derive_cache_salt` scopes the request's
`cache_salt` to its tenant. Response bodies live in `openai_responses`, the stop-string matcher
in workers/core/stop_strings.py. No FastAPI or Ray import: the app adapts these to HTTP.
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
MAX_BATCH_PROMPTS = 256  # prompts of one /v1/completions request

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
        # A check across fields: its message starts with the one at fault (in a list item,
        # e.g. a message, under that item).
        named = re.match(r"([a-z_]+)\b", message)
        if param is None:
            param = named.group(1) if named else None
        elif named and isinstance(first["loc"][-1], int):
            param = f"{param}.{named.group(1)}"
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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json (a schema), json_object, regex, choice or
    grammar (EBNF/GBNF or Lark). Its backend-tuning fields are refused in openai_body unless
    unset."""

    model_config = _REQUEST_CONFIG

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraints(self) -> list[tuple[str, StructuredOutput]]:
        given = []
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            given.append(("json", StructuredOutput(kind="json_schema", spec=schema)))
        if self.json_object:
            given.append(("json_object", StructuredOutput(kind="json")))
        if self.regex is not None:
            given.append(("regex", StructuredOutput(kind="regex", spec=self.regex)))
        if self.choice is not None:
            given.append(("choice", StructuredOutput(kind="choice", spec=json.dumps(self.choice))))
        if self.grammar is not None:
            given.append(("grammar", StructuredOutput(kind="grammar", spec=self.grammar)))
        return [(f"structured_outputs.{name}", spec) for name, spec in given]


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
    structured_outputs: StructuredOutputs | None = None
    # SGLang's names: a regex, an EBNF grammar, a JSON Schema (as text or an object).
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None

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
        """The output constraint and the parameter that gave it (one at most)."""
        given = self._constraints()
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise OpenAIError(
                400, f"give one output constraint, not several ({names}).", param=given[1][0]
            )
        return given[0] if given else None

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        """Every output constraint the request gives, with the parameter that gives it:
        response_format, vLLM's structured_outputs and guided_*, SGLang's."""
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
        if self.structured_outputs is not None:
            given.extend(self.structured_outputs.constraints())
        if self.regex is not None:
            given.append(("regex", StructuredOutput(kind="regex", spec=self.regex)))
        if self.ebnf is not None:
            given.append(("ebnf", StructuredOutput(kind="grammar", spec=self.ebnf)))
        if self.json_schema is not None:
            spec = self.json_schema
            text = spec if isinstance(spec, str) else json.dumps(spec)
            given.append(("json_schema", StructuredOutput(kind="json_schema", spec=text)))
        return given

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

    # One prompt or a batch (OpenAI's four shapes), as a list of prompts: text or token ids.
    prompt: list[str | list[int]]
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
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and value and not isinstance(value[0], (str, list))
        ):
            value = [value]  # one prompt: text, or token ids
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of token ids, or a list of those.")
        if len(value) > MAX_BATCH_PROMPTS:
            raise ValueError(
                f"prompt holds {len(value)} prompts; at most {MAX_BATCH_PROMPTS} per request."
            )
        for index, prompt in enumerate(value):
            where = f"prompt {index}" if len(value) > 1 else "prompt"
            if isinstance(prompt, str):
                continue
            if not isinstance(prompt, list) or not prompt:
                raise ValueError(f"{where} must be a string or a non-empty list of token ids.")
            for position, token_id in enumerate(prompt):
                if type(token_id) is not int:
                    raise ValueError(
                        f"{where}: token ids must be integers, got {token_id!r} at position "
                        f"{position}."
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


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """A 400 for a token id outside the vocabulary, which would index past the embedding
    table (docs/failure-handling.md)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(
                400,
                f"{param} contains token id {token_id}, which is outside the vocabulary "
                f"[0, {vocab_size}).",
                param=param,
            )


class FunctionCall(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(BaseModel):
    """An assistant message's tool call, as an earlier reply returned it."""

    model_config = _REQUEST_CONFIG

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat turn; `content` is text, or text parts joined with newlines (as vLLM does).
    An assistant turn may carry tool calls (and then no content); a tool turn answers one."""

    model_config = _REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's reasoning, as replies return it (templates may render it).
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"content part {index} has type {kind!r}, but only text parts "
                    "({'type': 'text', 'text': ...}) are supported."
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index} needs a string 'text'.")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _check_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them, not {self.role}.")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers.")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required: every message carries text.")
        return self

    def template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (HF's shape): tool-call arguments as
        objects, so that templates can walk them."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments, index, number),
                    },
                }
                for number, call in enumerate(self.tool_calls)
            ]
        return message


def _arguments(text: str, message: int, call: int) -> dict[str, Any]:
    param = f"messages[{message}].tool_calls[{call}].function.arguments"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OpenAIError(400, f"{param} is not JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{param} must be a JSON object.", param=param)
    return value


class FunctionDefinition(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    # NOTE: any JSON Schema object; no parameters: a function without arguments.
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _REQUEST_CONFIG

    name: str


class NamedToolChoice(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions; the output limit is `max_completion_tokens` or `max_tokens`."""

    _prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Templates: another one for this request, and variables for it (vLLM's); OpenAI's
    # reasoning_effort reaches templates that read it.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name.")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {self.tool_choice.function.name!r}, which "
                    "is not among the tools."
                )
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools.")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How this request uses its tools (OpenAI's default: auto with tools, else none)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        return {tool.function.name: tool.function.parameters for tool in self.tools or ()}

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        given = super()._constraints()
        if self.tool_mode in ("required", "named"):
            # A forced call writes no message, so response_format (the message's shape) has
            # nothing to apply to: agent frameworks send both.
            given = [(name, spec) for name, spec in given if name != "response_format"]
            schema = forced_tool_schema(self)
            given.append(("tool_choice", StructuredOutput(kind="json_schema", spec=schema)))
        return given

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it (HF's message dicts)."""
        return [m.template_message(i) for i, m in enumerate(self.messages)]

    def template_variables(self) -> dict[str, Any]:
        """What the template renders with besides the messages: the tools (unless the
        request chose none), `chat_template_kwargs` and `reasoning_effort`."""
        variables = dict(self.chat_template_kwargs or {})
        if self.tool_mode != "none":
            variables["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables


def forced_tool_schema(body: ChatCompletionRequest) -> str:
    """What `required` and a named function constrain the output to, as vLLM does: a named
    function's arguments object, or a list of `{"name", "parameters"}` calls of the tools
    (one only without parallel_tool_calls). `chat_output.ForcedToolCalls` reads it back."""
    schemas = body.tool_schemas()
    if isinstance(body.tool_choice, NamedToolChoice):
        return json.dumps(schemas[body.tool_choice.function.name])
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in schemas.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not body.parallel_tool_calls:
        array["maxItems"] = 1
    return json.dumps(array)


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize for a prompt (chat messages parse as a chat request)."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    prompt: str | list[int]


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    tokens: list[int]


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
