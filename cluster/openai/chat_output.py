"""A chat choice's text, read as OpenAI's assistant message: reasoning, content and tool
calls.

    text ──> ThinkParser ──> reasoning_content
                        └──> ToolCallExtractor ──> content, tool_calls      (tool_choice auto)
    text ──> ForcedToolCalls ──> tool_calls           (tool_choice required or a named function)

`ChatParsing` is the server's choice of parsers (configured, or read from the chat template);
`parser` makes one `ChatOutputParser` per choice of a request. Without tools and without
thinking markers a choice's text is its content, as before.

A forced choice constrains the output to JSON (`protocol.forced_tool_schema`) from its first
token, so its output is never reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridserve.cluster.openai.protocol import ChatCompletionRequest
from hybridserve.cluster.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ThinkParser,
    detect_reasoning,
)
from hybridserve.cluster.openai.tool_parsers import (
    FORMATS,
    Extracted,
    ToolCall,
    ToolCallExtractor,
    ToolCallFormat,
    detect_format,
)


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    first_call_index: int = 0  # the index of tool_calls[0] among the choice's calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def then(self, later: MessageDelta) -> MessageDelta:
        """This delta followed by `later`, as one."""
        return MessageDelta(
            self.reasoning + later.reasoning,
            self.content + later.content,
            [*self.tool_calls, *later.tool_calls],
            self.first_call_index,
        )


class ForcedToolCalls:
    """The JSON a forced tool choice produced, read back at the end: a named function's
    arguments, or the list of `{"name", "parameters"}` calls `required` asks for. Output that
    is not that JSON (cut by max_tokens) stays content."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.text = ""

    holding = True  # nothing is known before the end

    def feed(self, text: str) -> Extracted:
        self.text += text
        return Extracted()

    def finish(self) -> Extracted:
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return Extracted(content=self.text)
        if self.name is not None:
            return Extracted(calls=[ToolCall.of(self.name, value)])
        return Extracted(calls=[ToolCall.of(c["name"], c["parameters"]) for c in value])


class ChatOutputParser:
    """One choice's message as its text arrives; `holding` while text waits on a marker."""

    def __init__(
        self,
        *,
        reasoning: ThinkParser | None,
        tools: ToolCallExtractor | ForcedToolCalls | None,
        include_reasoning: bool = True,
        parallel_tool_calls: bool = True,
        calls_finish: bool = True,
    ) -> None:
        """`calls_finish`: a choice that called tools ends with finish_reason "tool_calls"
        (OpenAI's for auto and required; a named function's call ends with "stop")."""
        self.calls_finish = calls_finish
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning
        self.max_calls = None if parallel_tool_calls else 1
        self.num_calls = 0

    @property
    def holding(self) -> bool:
        return bool(
            (self.reasoning is not None and self.reasoning.holding)
            or (self.tools is not None and self.tools.holding)
        )

    def feed(self, text: str) -> MessageDelta:
        if self.reasoning is None:
            return self._content(text, final=False)
        split = self.reasoning.feed(text)
        return self._with_reasoning(split.reasoning, self._content(split.content, final=False))

    def finish(self) -> MessageDelta:
        if self.reasoning is None:
            return self._content("", final=True)
        split = self.reasoning.finish()
        return self._with_reasoning(split.reasoning, self._content(split.content, final=True))

    def _with_reasoning(self, reasoning: str, delta: MessageDelta) -> MessageDelta:
        if self.include_reasoning:
            delta.reasoning = reasoning
        return delta

    def _content(self, text: str, *, final: bool) -> MessageDelta:
        if self.tools is None:
            return MessageDelta(content=text)
        delta = MessageDelta()
        parts = [self.tools.feed(text)] if text else []
        if final:
            parts.append(self.tools.finish())
        for part in parts:
            delta.content += part.content
            delta.tool_calls.extend(part.calls)
        if self.max_calls is not None:  # parallel_tool_calls=false: the first call only
            room = max(0, self.max_calls - self.num_calls)
            delta.tool_calls = delta.tool_calls[:room]
        delta.first_call_index = self.num_calls
        self.num_calls += len(delta.tool_calls)
        return delta


@dataclass(frozen=True)
class ChatParsing:
    """The server's output parsers: a tool-call format and a reasoning parser, each named in
    the configuration or read from the chat template ("auto"), or off ("none")."""

    tool_format: type[ToolCallFormat] | None
    reasoning: type[ThinkParser] | None
    auto_tool_choice: bool = True

    @classmethod
    def resolve(
        cls,
        template: str | None,
        *,
        tool_call_parser: str,
        reasoning_parser: str,
        auto_tool_choice: bool = True,
    ) -> ChatParsing:
        """The parsers a configuration names (ServiceConfig checked the names)."""
        tool_format = {"auto": detect_format(template), "none": None}.get(
            tool_call_parser, FORMATS.get(tool_call_parser)
        )
        reasoning = {"auto": detect_reasoning(template), "none": None}.get(
            reasoning_parser, REASONING_PARSERS.get(reasoning_parser)
        )
        return cls(tool_format, reasoning, auto_tool_choice)

    def parser(self, body: ChatCompletionRequest, prompt_text: str) -> ChatOutputParser:
        mode = body.tool_mode
        tools: ToolCallExtractor | ForcedToolCalls | None = None
        reasoning = None
        if mode in ("required", "named"):
            named = body.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
            tools = ForcedToolCalls(named)
        else:
            if self.reasoning is not None:
                reasoning = self.reasoning(prompt_text)
            if mode == "auto" and self.tool_format is not None:
                tools = ToolCallExtractor(self.tool_format(), body.tool_schemas())
        return ChatOutputParser(
            reasoning=reasoning,
            tools=tools,
            include_reasoning=body.include_reasoning,
            parallel_tool_calls=body.parallel_tool_calls,
            calls_finish=mode != "named",
        )
