"""Tool calls in the text a model writes, in each served family's format, and back out as
OpenAI's `tool_calls`.

A format is a pair of markers around one call block and the reading of what is inside:

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen3-Next, Granite
                                                                             4.0, the tiny model
    qwen3_coder   <tool_call><function=NAME><parameter=P>value</parameter>   Qwen3.5, Qwen3-Coder
                  </function></tool_call>
    nemotron_json <TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>   Nemotron-H
    jamba         <tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>   Jamba 1.5+
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0       Kimi Linear
                  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    lfm2          <|tool_call_start|>[name(key="value", n=1), ...]<|tool_call_end|>   LFM2
    olmo3         <function_calls>name(key="value")\nother(n=1)</function_calls>     OLMo 3,
                                                                             OLMo-Hybrid

`ToolCallExtractor` reads a choice's text as it streams: text outside the blocks is content,
each block becomes its calls when its end marker arrives (or when the output ends), and a
block that does not read as calls stays in the content, as the model wrote it. Text that could
still become a start marker is held back, so a marker split across tokens never leaks into
the content. The same extractor serves streamed and whole replies, so both carry the same
calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=new_call_id)

    @classmethod
    def of(cls, name: str, arguments: Any) -> ToolCall:
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return cls(name, arguments)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry, or (with `index`) as a stream delta's."""
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


# The tools of a request by name: each one's JSON Schema for its parameters.
ToolSchemas = Mapping[str, Mapping[str, Any]]


class ToolCallFormat(ABC):
    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str]

    @classmethod
    @abstractmethod
    def writes(cls, template: str) -> bool:
        """Whether a chat template renders tool calls in this format."""

    @abstractmethod
    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        """The calls between a start and an end marker; None when they do not read as calls."""


def _json_calls(value: Any) -> list[ToolCall] | None:
    """`{"name", "arguments"}` objects (or a list of them) as calls; vLLM's clients also see
    "parameters" for the arguments."""
    entries = value if isinstance(value, list) else [value]
    calls = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            return None
        arguments = entry.get("arguments", entry.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall.of(entry["name"], arguments))
    return calls


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template and "<function=" not in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        value = _load_json(block.strip())
        return None if isinstance(value, list) else _json_calls(value)


class NemotronJsonFormat(ToolCallFormat):
    name = "nemotron_json"
    start, end = "<TOOLCALL>", "</TOOLCALL>"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        value = _load_json(block.strip())
        return _json_calls(value) if isinstance(value, list) else None


class JambaFormat(ToolCallFormat):
    """Jamba 1.5 and later: one JSON list of calls."""

    name = "jamba"
    start, end = "<tool_calls>", "</tool_calls>"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        value = _load_json(block.strip())
        return _json_calls(value) if isinstance(value, list) else None


_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*((?:functions\.)?([^:<\s]+):\d+)\s*"
    r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
    re.DOTALL,
)


class KimiK2Format(ToolCallFormat):
    """Kimi K2 and Kimi Linear: a section of calls, each `functions.NAME:INDEX` then its JSON
    arguments. That id is the call's id too: the template writes it back, and the name with
    it, when the calls return in the next prompt."""

    name = "kimi_k2"
    start, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        calls, position = [], 0
        while position < len(block):
            match = _KIMI_CALL.match(block, position)
            if match is None:
                return None
            arguments = _load_json(match.group(3).strip())
            if not isinstance(arguments, dict):
                return None
            calls.append(replace(ToolCall.of(match.group(2), arguments), id=match.group(1)))
            position = match.end()
        return calls or None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderFormat(ToolCallFormat):
    """Qwen3.5's XML form: one parameter per tag, its value as text. A value is read by the
    type its tool's schema gives the parameter: strings as written, anything else as JSON
    (falling back to the text when it is not JSON)."""

    name = "qwen3_coder"
    start, end = "<tool_call>", "</tool_call>"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template and "<function=" in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        function = _FUNCTION.fullmatch(block)
        if function is None:
            return None
        name, body = function.group(1).strip(), function.group(2)
        properties = tools.get(name, {}).get("properties", {})
        arguments = {}
        for parameter in _PARAMETER.finditer(body):
            key, text = parameter.group(1).strip(), parameter.group(2)
            kind = properties.get(key, {}).get("type") if isinstance(properties, dict) else None
            arguments[key] = text if kind in ("string", None) else _typed(text)
        return [ToolCall.of(name, arguments)]


def _typed(text: str) -> Any:
    value = _load_json(text.strip())
    return text if value is None and text.strip() != "null" else value


class PythonicFormat(ToolCallFormat):
    """Calls written as Python: keyword arguments only, each a literal (Python's, or JSON's
    true / false / null, which templates that render with `tojson` write)."""

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        return _python_calls(block.strip())


class Lfm2Format(PythonicFormat):
    """LFM2: one Python list of calls."""

    name = "lfm2"
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"


class Olmo3Format(PythonicFormat):
    """OLMo 3: one call a line, or a list of them."""

    name = "olmo3"
    start, end = "<function_calls>", "</function_calls>"

    def read(self, block: str, tools: ToolSchemas) -> list[ToolCall] | None:
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if len(lines) > 1 or (lines and not lines[0].startswith("[")):
            return _python_calls(f"[{', '.join(lines)}]")
        return _python_calls(block.strip())


def _python_calls(text: str) -> list[ToolCall] | None:
    """A Python list of keyword calls as calls; None when the text is not one."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args:  # type: ignore[union-attr]
            return None
        arguments = {}
        for keyword in node.keywords:  # type: ignore[union-attr]
            if keyword.arg is None:
                return None
            value = _literal(keyword.value)
            if value is _NOT_LITERAL:
                return None
            arguments[keyword.arg] = value
        calls.append(ToolCall.of(name, arguments))
    return calls


_NOT_LITERAL = object()
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _dotted(node: ast.expr) -> str | None:
    """A function's name as written, dots included (`get_weather`, `tools.search`)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """The value a literal expression spells, JSON's names included; _NOT_LITERAL otherwise."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        items = [_literal(item) for item in node.elts]
        return _NOT_LITERAL if _NOT_LITERAL in items else items
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else _NOT_LITERAL for k in node.keys]
        values = [_literal(v) for v in node.values]
        if not all(isinstance(k, (str, int, float)) for k in keys) or _NOT_LITERAL in values:
            return _NOT_LITERAL
        return dict(zip(keys, values, strict=True))
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NOT_LITERAL


FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f
    for f in (
        HermesFormat,
        Qwen3CoderFormat,
        NemotronJsonFormat,
        JambaFormat,
        KimiK2Format,
        Lfm2Format,
        Olmo3Format,
    )
}


def detect_format(template: str | None) -> type[ToolCallFormat] | None:
    """The one format a chat template writes tool calls in; None when none or several."""
    if template is None:
        return None
    found = [f for f in FORMATS.values() if f.writes(template)]
    return found[0] if len(found) == 1 else None


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could still begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class Extracted:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallExtractor:
    """One choice's content, split into text and calls as it arrives (module docstring).

    Whitespace between calls, and around them, is not content: it is held until text follows.
    """

    def __init__(self, format: ToolCallFormat, tools: ToolSchemas) -> None:
        self.format = format
        self.tools = tools
        self.buffer = ""
        self.in_block = False
        self.num_calls = 0
        self.whitespace = ""  # content whitespace not yet known to be followed by text
        self.after_call = False  # the whitespace that follows a call is not content either

    @property
    def holding(self) -> bool:
        return bool(self.buffer or self.whitespace or self.in_block)

    def feed(self, text: str) -> Extracted:
        self.buffer += text
        out = Extracted()
        while True:
            if self.in_block:
                end = self.buffer.find(self.format.end)
                if end < 0:
                    return out
                self._close(self.buffer[:end], out)
                self.buffer = self.buffer[end + len(self.format.end) :]
                continue
            start = self.buffer.find(self.format.start)
            if start < 0:
                keep = held_prefix(self.buffer, self.format.start)
                self._content(self.buffer[: len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return out
            self._content(self.buffer[:start], out)
            self.buffer = self.buffer[start + len(self.format.start) :]
            self.in_block = True

    def finish(self) -> Extracted:
        """What is left when the output ends: an unterminated block is read as it stands."""
        out = Extracted()
        if self.in_block:
            self._close(self.buffer, out, terminated=False)
        else:
            self._content(self.buffer, out)
        self.buffer = ""
        if not self.num_calls:
            out.content += self.whitespace
        self.whitespace = ""
        return out

    def _close(self, block: str, out: Extracted, *, terminated: bool = True) -> None:
        self.in_block = False
        calls = self.format.read(block, self.tools)
        if calls is None:
            end = self.format.end if terminated else ""
            self._content(self.format.start + block + end, out)
            return
        self.whitespace = ""
        self.after_call = True
        self.num_calls += len(calls)
        out.calls.extend(calls)

    def _content(self, text: str, out: Extracted) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if not text:
            return
        stripped = text.rstrip()
        if not stripped:
            self.whitespace += text
            return
        out.content += self.whitespace + stripped
        self.whitespace = text[len(stripped) :]
