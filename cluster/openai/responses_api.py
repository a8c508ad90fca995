"""OpenAI's Responses API (`POST /v1/responses`), served as a chat completion.

A request becomes a `ChatCompletionRequest`: `instructions` a leading system message, input
items messages (function calls an assistant turn's `tool_calls`, their outputs tool turns),
flat function tools chat tools, `text.format` a response_format, `reasoning.effort` the
template's reasoning_effort. Its answer is read back from the chat reply: reasoning, message
and function-call output items, or, streamed, the events of OpenAI's shape, each numbered.

`previous_response_id` continues a stored response: its conversation (without its
instructions, as OpenAI does) comes before the new input. Stored responses live in the
ingress replica's memory, the oldest dropped past `ResponseStore.capacity`. The conversation
renders as a prefix of the new prompt, so the router sends it to the engine that holds its
snapshot, as it does for chat.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hybridserve.cluster.openai.protocol import OpenAIError, ReasoningEffort

_CONFIG = ConfigDict(strict=True, extra="ignore", frozen=True)


class FunctionTool(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    # NOTE: any JSON Schema object.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = _CONFIG

    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["medium"] | None = None  # the only one a model without it follows


class ReasoningOptions(BaseModel):
    model_config = _CONFIG

    effort: ReasoningEffort | None = None
    # Summaries would need a second pass over the reasoning: only "none" is served.
    summary: None = None


class ResponsesRequest(BaseModel):
    model_config = _CONFIG

    model: str | None = None
    # Input items are dicts of many shapes, read one by one in `input_messages`.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def chat_request(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request that answers this one after `history` (the stored
        conversation of previous_response_id)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [*history, *input_messages(self.input)]
        chat: dict[str, Any] = {
            "messages": messages,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
            choice = self.tool_choice
            if isinstance(choice, NamedFunctionChoice):
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                chat["tool_choice"] = choice
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "model", "user"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif form is not None and form.type == "json_schema":
            schema = {"name": form.name, "schema": form.schema_ or {}}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        return chat


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant turn before them (or
    open one), their outputs become tool turns, reasoning items that turn's reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant_turn() -> dict[str, Any]:
        if not (messages and messages[-1]["role"] == "assistant"):
            messages.append({"role": "assistant", "content": None})
        return messages[-1]

    for index, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(
                    400, f"{where}.role: {role!r} is not a message role.", param=f"{where}.role"
                )
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise OpenAIError(
                        400, f"{where}.{key} must be a string.", param=f"{where}.{key}"
                    )
            turn = assistant_turn()
            if reasoning:
                turn["reasoning_content"] = "".join(reasoning)
                reasoning = []
            call = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise OpenAIError(
                    400, f"{where}.call_id must be a string.", param=f"{where}.call_id"
                )
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        else:
            raise OpenAIError(
                400,
                f"{where}.type: {kind!r} items are not supported (messages, function_call, "
                "function_call_output and reasoning are).",
                param=f"{where}.type",
            )
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(
            400, f"{where}.content must be text or a list of text parts.", param=f"{where}.content"
        )
    texts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                400,
                f"{where}.content[{number}] has type {kind!r}; only text parts are supported.",
                param=f"{where}.content[{number}]",
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


# ---- the answer ---------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseState:
    """One response in the making: its envelope, output items and usage."""

    request: ResponsesRequest
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    model: str = ""
    output: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"
    incomplete: str | None = None
    usage: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        request = self.request
        form = request.text.format if request.text is not None else TextFormat()
        choice = request.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": self.output,
            "instructions": request.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools],
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "reasoning": {
                "effort": request.reasoning.effort if request.reasoning else None,
                "summary": None,
            },
            "text": {"format": form.model_dump(by_alias=True, exclude_none=True)},
            "truncation": "disabled",
            "store": request.store,
            "metadata": request.metadata or {},
            "user": request.user,
            "usage": self.usage,
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "error": None,
        }

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.incomplete = "max_output_tokens" if finish_reason == "length" else None
        details = usage.get("prompt_tokens_details") or {}
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat turn the conversation continues from (its content empty,
        not absent, when it wrote none: cut while reasoning, or nothing at all)."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        return message


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(
    text: str, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status == "completed" else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's message as output items: reasoning, then text, then calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    items.extend(function_call_item(call) for call in message.get("tool_calls") or ())
    return items


class ResponseEvents:
    """The streamed events of one response, from the chat reply's stream deltas: an output
    item opens when its kind of text first arrives and closes when another kind follows."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the output item being streamed
        self.text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        body = self.state.body()
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._close()
            item = function_call_item(call, status="in_progress")
            index = len(self.state.output)
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            arguments = call["function"]["arguments"]
            common = {"item_id": item["id"], "output_index": index}
            events.append(
                self.event("response.function_call_arguments.delta", delta=arguments, **common)
            )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    arguments=arguments,
                    name=item["name"],
                    **common,
                )
            )
            done = item | {"arguments": arguments, "status": "completed"}
            self.state.output.append(done)
            events.append(self.event("response.output_item.done", output_index=index, item=done))
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.state.finish(finish_reason, usage)
        kind = "response.incomplete" if self.state.status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.state.body())]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = (
                reasoning_item("")
                if kind == "reasoning"
                else message_item("", status="in_progress")
            )
            if kind == "reasoning":
                item["content"] = []
            self.open, self.text = item, ""
            index = len(self.state.output)
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            part = (
                {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        self.text += text
        index = len(self.state.output)
        common = {"item_id": self.open["id"], "output_index": index, "content_index": 0}
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, delta=text, **common, **extra))
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, text, self.open = self.open, self.text, None
        index = len(self.state.output)
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(text, item["id"])
            part = done["content"][0]
            events = [self.event("response.reasoning_text.done", text=text, **common)]
        else:
            done = message_item(text, item["id"])
            part = done["content"][0]
            events = [self.event("response.output_text.done", text=text, logprobs=[], **common)]
        events.append(self.event("response.content_part.done", part=part, **common))
        self.state.output.append(done)
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        return events


class ResponseStore:
    """Stored responses of this ingress replica: id -> (its tenant; the conversation through
    the response, as chat messages without instructions; the response body). A response is
    its tenant's only: another tenant's id reads as unknown. The oldest go first past
    `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[
            str, tuple[str | None, list[dict[str, Any]], dict[str, Any]]
        ] = collections.OrderedDict()

    def put(
        self,
        response_id: str,
        tenant: str | None,
        conversation: list[dict[str, Any]],
        body: dict[str, Any],
    ) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = (tenant, conversation, body)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(
        self, response_id: str, tenant: str | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != tenant:
            raise OpenAIError(
                404,
                f"Response with id '{response_id}' not found (responses are kept in memory, the "
                f"last {self.capacity} stored).",
                param="previous_response_id",
                code="response_not_found",
            )
        self._entries.move_to_end(response_id)
        return entry[1], entry[2]

    def delete(self, response_id: str, tenant: str | None) -> None:
        self.get(response_id, tenant)
        del self._entries[response_id]


def sse_named_event(event: dict[str, Any]) -> str:
    """One server-sent event of the Responses API, named by its type (no [DONE] at the end)."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
