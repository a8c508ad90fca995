"""Each family's template with tools: the parsers are read from it, a tool call the model
writes in the family's format becomes OpenAI's `tool_calls`, and those render back into the
next prompt as the same call (read again, they are the calls the model wrote). Oracle: the
scripted output's calls."""

from __future__ import annotations

import json

import pytest

from hybridserve.cluster.openai.chat_output import ChatParsing, MessageDelta
from hybridserve.cluster.openai.protocol import ChatCompletionRequest
from hybridserve.cluster.openai.tool_parsers import FORMATS, ToolCallExtractor
from hybridserve.workers.core.tokenizer import Tokenizer
from hybridserve.workers.models.tiny import tiny_tokenizer_backend
from tests.cluster.openai.family_templates import EXPECTED_PARSERS, FAMILIES, written

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
CONVERSATION = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather and time in Paris?"},
]


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(tiny_tokenizer_backend(), chat_template=template)


def parsing(template: str) -> ChatParsing:
    return ChatParsing.resolve(template, tool_call_parser="auto", reasoning_parser="auto")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_parsers_are_read_from_the_template(family):
    chosen = parsing(FAMILIES[family])
    format_name, thinks = EXPECTED_PARSERS[family]
    assert chosen.tool_format is not None and chosen.tool_format.name == format_name
    assert (chosen.reasoning is not None) == thinks


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_call_round_trips_through_the_family_template(family):
    template = FAMILIES[family]
    format_name, thinks = EXPECTED_PARSERS[family]
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    prompt = tokenizer(template).apply_chat_template(
        body.template_messages(), **body.template_variables()
    )
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # the tools are listed

    # The model's turn: reasoning (where the template opened it), then both calls.
    output = ("Paris, so two calls.\n</think>\n\n" if thinks else "") + written(format_name, CALLS)
    parser = parsing(template).parser(body, prompt)
    message = MessageDelta()
    for char in output:  # streamed a character at a time
        message = message.then(parser.feed(char))
    message = message.then(parser.finish())
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == CALLS
    assert message.content == ""
    assert message.reasoning == ("Paris, so two calls.\n" if thinks else "")

    # The reply goes back as the assistant turn, with the tool's answer after it.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [c.to_openai() for c in message.tool_calls],
    }
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
    turn = [*CONVERSATION, assistant, answer]
    follow_up = ChatCompletionRequest.model_validate({"messages": turn, "tools": TOOLS})
    rendered = tokenizer(template).apply_chat_template(
        follow_up.template_messages(), **follow_up.template_variables()
    )
    before = tokenizer(template).apply_chat_template(
        body.template_messages(), add_generation_prompt=False, **body.template_variables()
    )
    assert rendered.startswith(before)
    assistant_turn = rendered[len(before) :]
    assert "sunny" in assistant_turn
    extractor = ToolCallExtractor(FORMATS[format_name](), follow_up.tool_schemas())
    read_back = extractor.feed(assistant_turn).calls + extractor.finish().calls
    assert [(c.name, json.loads(c.arguments)) for c in read_back] == CALLS


def test_granite_prints_today_through_strftime_now():
    import datetime

    prompt = tokenizer(FAMILIES["granite_4"]).apply_chat_template(CONVERSATION)
    assert f"Today is {datetime.date.today():%B %d, %Y}." in prompt


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_enable_thinking_false_closes_the_block_in_the_prompt(family):
    template = FAMILIES[family]
    for enabled, reasoning in ((True, "all of it"), (False, "")):
        prompt = tokenizer(template).apply_chat_template(CONVERSATION, enable_thinking=enabled)
        parser = parsing(template).parser(
            ChatCompletionRequest.model_validate({"messages": CONVERSATION}), prompt
        )
        message = parser.feed("all of it").then(parser.finish())
        assert message.reasoning == reasoning
        assert message.content == ("" if enabled else "all of it")
