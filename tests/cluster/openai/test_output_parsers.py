"""Tool calls and reasoning read back from a model's text, in each served family's format.

Oracle: the calls and texts the scripted outputs were written with. Every output is also fed
one character at a time, and in random pieces, to show that a stream yields exactly what the
whole text does (markers split across tokens included)."""

from __future__ import annotations

import json
import random

import pytest

from hybridserve.cluster.openai.chat_output import ChatOutputParser, ForcedToolCalls, MessageDelta
from hybridserve.cluster.openai.reasoning_parsers import ThinkParser
from hybridserve.cluster.openai.tool_parsers import (
    FORMATS,
    ToolCallExtractor,
    detect_format,
    held_prefix,
)
from tests.cluster.openai.family_templates import written

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run(parser: ChatOutputParser, text: str, how: str) -> MessageDelta:
    message = MessageDelta()
    for piece in pieces(text, how):
        message = message.then(parser.feed(piece))
    return message.then(parser.finish())


def tool_parser(format_name: str, prompt: str = "", *, reasoning: bool = False):
    return ChatOutputParser(
        reasoning=ThinkParser(prompt) if reasoning else None,
        tools=ToolCallExtractor(FORMATS[format_name](), TOOLS),
    )


HOW = ["whole", "chars", "random"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_calls_in_each_format_read_back_with_the_text_around_them(format_name, how):
    text = "Let me check.\n\n" + written(format_name, CALLS)
    message = run(tool_parser(format_name), text, how)
    assert message.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == CALLS


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_text_without_calls_is_all_content(format_name, how):
    text = "No tools needed: 2 < 3 and <tool is not a marker.\n"
    message = run(tool_parser(format_name), text, how)
    assert message.content == text and not message.tool_calls


@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_a_block_that_does_not_read_as_calls_stays_content(format_name):
    fmt = FORMATS[format_name]
    text = f"{fmt.start}not a call{fmt.end}"
    message = run(tool_parser(format_name), text, "chars")
    assert message.content == text and not message.tool_calls


@pytest.mark.parametrize("format_name", sorted(FORMATS))
def test_a_call_cut_before_its_end_marker_is_read_when_it_is_complete(format_name):
    text = written(format_name, CALLS[:1])
    cut = text[: text.rindex(FORMATS[format_name].end)]
    message = run(tool_parser(format_name), cut, "chars")
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == CALLS[:1]


def test_qwen3_coder_parameters_take_their_schema_types():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = run(tool_parser("qwen3_coder"), text, "whole").tool_calls
    assert json.loads(call.arguments) == {"city": "42", "days": 7}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    ("prompt", "output", "reasoning", "content"),
    [
        # The generation prompt opened the block (Qwen3.5, Nemotron with thinking on).
        ("<|im_start|>assistant\n<think>\n", "step 1\n</think>\n\nAnswer.", "step 1\n", "Answer."),
        # The model opens it itself.
        ("<|im_start|>assistant\n", "<think>\nhm\n</think>\n\nAnswer.", "hm\n", "Answer."),
        # Thinking off: the prompt closed an empty block.
        ("assistant\n<think>\n\n</think>\n\n", "Answer <think> here.", "", "Answer <think> here."),
        # No block at all.
        ("assistant\n", "Plain answer.", "", "Plain answer."),
        # Cut inside the reasoning: all of it is reasoning.
        ("assistant\n<think>\n", "still thinking", "still thinking", ""),
        # A <think> the user wrote earlier opens nothing: only the prompt's end counts.
        ("user\nwhat is <think>?\nassistant\n", "A tag.", "", "A tag."),
    ],
)
def test_reasoning_is_split_where_the_markers_are(prompt, output, reasoning, content, how):
    parser = ChatOutputParser(reasoning=ThinkParser(prompt), tools=None)
    message = run(parser, output, how)
    assert (message.reasoning, message.content) == (reasoning, content)


@pytest.mark.parametrize("how", HOW)
def test_calls_after_reasoning_are_read_and_calls_inside_it_are_not(how):
    inside = written("hermes", CALLS[1:])
    output = f"I could write {inside} but\n</think>\n\n" + written("hermes", CALLS[:1])
    message = run(tool_parser("hermes", "<think>\n", reasoning=True), output, how)
    assert message.reasoning == f"I could write {inside} but\n"
    assert message.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == CALLS[:1]


def test_include_reasoning_false_drops_it():
    parser = ChatOutputParser(reasoning=ThinkParser("<think>"), tools=None, include_reasoning=False)
    assert run(parser, "a</think>b", "chars") == MessageDelta(content="b")


def test_parallel_tool_calls_false_keeps_the_first_call():
    parser = ChatOutputParser(
        reasoning=None,
        tools=ToolCallExtractor(FORMATS["hermes"](), TOOLS),
        parallel_tool_calls=False,
    )
    message = run(parser, written("hermes", CALLS), "chars")
    assert [c.name for c in message.tool_calls] == ["get_weather"]


def test_forced_calls_read_the_constrained_json():
    named = run(ChatOutputParser(reasoning=None, tools=ForcedToolCalls("f")), '{"a": 1}', "chars")
    assert [(c.name, json.loads(c.arguments)) for c in named.tool_calls] == [("f", {"a": 1})]
    required = ChatOutputParser(reasoning=None, tools=ForcedToolCalls(None))
    listed = run(required, '[{"name": "g", "parameters": {}}]', "whole")
    assert [(c.name, c.arguments) for c in listed.tool_calls] == [("g", "{}")]
    cut = run(ChatOutputParser(reasoning=None, tools=ForcedToolCalls("f")), '{"a": ', "whole")
    assert cut == MessageDelta(content='{"a": ')


def test_lfm2_calls_read_python_and_json_literals_and_dotted_names():
    text = (
        '<|tool_call_start|>[get_weather(city="Paris", days=3, '
        'opts={"units": "C", "x": [1, None]}), '
        "tools.search(q='a\\'b', exact=True, page=null)]<|tool_call_end|>"
    )
    first, second = run(tool_parser("lfm2"), text, "chars").tool_calls
    assert (first.name, json.loads(first.arguments)) == (
        "get_weather",
        {"city": "Paris", "days": 3, "opts": {"units": "C", "x": [1, None]}},
    )
    assert (second.name, json.loads(second.arguments)) == (
        "tools.search",
        {"q": "a'b", "exact": True, "page": None},
    )


@pytest.mark.parametrize(
    "body",
    ["get_time()", "[get_time(1)]", "[get_time(x=y)]", "[f(**kw)]", "[f(x={[1]: 2})]", "[f("],
)
def test_lfm2_blocks_that_are_not_keyword_literal_calls_stay_content(body):
    text = f"<|tool_call_start|>{body}<|tool_call_end|>"
    message = run(tool_parser("lfm2"), text, "whole")
    assert message.content == text and not message.tool_calls


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ('{{ "<tool_call>\\n" + call | tojson }}', "hermes"),
        ("{{ '<tool_call>\\n<function=' + name + '>' }}", "qwen3_coder"),
        ("<TOOLCALL>{{ calls | tojson }}</TOOLCALL>", "nemotron_json"),
        ("<|tool_call_start|>[{{ call }}]<|tool_call_end|>", "lfm2"),
        ("<function_calls>{{ call }}</function_calls>", "olmo3"),
        ("{{ messages }}", None),
    ],
)
def test_the_format_is_read_from_the_template(template, expected):
    detected = detect_format(template)
    assert (detected.name if detected else None) == expected


def test_held_prefix():
    assert held_prefix("abc<tool", "<tool_call>") == 5
    assert held_prefix("abc", "<tool_call>") == 0
    assert held_prefix("<tool_call", "<tool_call>") == 10
