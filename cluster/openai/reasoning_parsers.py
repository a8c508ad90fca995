"""A thinking model's reasoning, split from its answer: `reasoning_content` in replies and
stream deltas, the rest `content`.

Every family we serve that thinks marks it the same way, `<think>` ... `</think>` (Qwen3.5,
Qwen3-Next thinking models, Nemotron-H). Where the thinking block opens decides where the
output starts:

- templates that open it in the generation prompt (Qwen3.5, Nemotron with thinking on): the
  output starts inside the reasoning and only writes the end marker;
- templates that leave it to the model: the output starts with `<think>` or is all content;
- templates that render an empty block when thinking is off (`enable_thinking=False`): the
  prompt has closed it, and the output is all content.

So the parser reads the rendered prompt: a `<think>` at its very end (the generation prompt
opened the block) means the output starts in the reasoning. An output that ends before
`</think>` is all reasoning, as vLLM's parsers return it. The newlines the markers are written
with are not part of either text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridserve.cluster.openai.tool_parsers import held_prefix


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkParser:
    name: ClassVar[str] = "think"
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, prompt_text: str) -> None:
        # Only the generation prompt's end counts: a `<think>` a user wrote earlier in the
        # conversation opens nothing. "opening": the output may still open a block (first,
        # after whitespace).
        opened = prompt_text.rstrip().endswith(self.start)
        self.state = "reasoning" if opened else "opening"
        self.buffer = ""
        self.strip_newlines = self.state == "reasoning"

    @classmethod
    def writes(cls, template: str) -> bool:
        return cls.start in template and cls.end in template

    @property
    def holding(self) -> bool:
        return bool(self.buffer)

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split()
        while self.buffer:
            if self.state == "opening":
                head = self.buffer.lstrip()
                if not head or (len(head) < len(self.start) and self.start.startswith(head)):
                    return out  # still whitespace, or the start marker so far
                if head.startswith(self.start):
                    self.buffer = head[len(self.start) :]
                    self.state, self.strip_newlines = "reasoning", True
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.buffer.find(self.end)
                if end < 0:
                    keep = held_prefix(self.buffer, self.end)
                    out.reasoning += self._text(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                out.reasoning += self._text(self.buffer[:end])
                self.buffer = self.buffer[end + len(self.end) :]
                self.state, self.strip_newlines = "content", True
            else:
                out.content += self._text(self.buffer)
                self.buffer = ""
        return out

    def finish(self) -> Split:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return Split(reasoning=self._text(rest))
        return Split(content=self._text(rest))

    def _text(self, text: str) -> str:
        """`text`, without the newlines right after a marker."""
        if self.strip_newlines:
            text = text.lstrip("\n")
            self.strip_newlines = not text
        return text


# vLLM's names for the parsers of these families read the same markers.
REASONING_PARSERS: dict[str, type[ThinkParser]] = {
    "think": ThinkParser,
    "qwen3": ThinkParser,
    "deepseek_r1": ThinkParser,
}


def detect_reasoning(template: str | None) -> type[ThinkParser] | None:
    return ThinkParser if template is not None and ThinkParser.writes(template) else None
