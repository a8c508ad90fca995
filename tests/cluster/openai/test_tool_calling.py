"""Tool calls, reasoning, templates and structured output over HTTP with the `openai` client
(tests/cluster/openai/local_api.py: one engine in process, no Ray).

Oracles: the tool's JSON Schema for forced calls (and the streamed reply for the whole one);
the same prompt as a plain completion for what reasoning parsing splits; the constraint
itself for structured output."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.cluster.openai.family_templates import QWEN3_5
from tests.cluster.openai.local_api import local_api, local_client
from tests.helpers import assert_pools_at_baseline

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_tokens": 96}
ENGINE = {"max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 1024}


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[openai.OpenAI, Any]]:
    with local_api(engine=ENGINE, trust_request_chat_template=True) as (url, host):
        yield local_client(url), host


@pytest.fixture(autouse=True)
def at_baseline(api):
    yield
    assert_pools_at_baseline(api[1].engine)


def tokenize(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's POST /tokenize (at the server's root, beside /v1)."""
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/tokenize"
    reply = httpx.post(url, json={"model": "tiny"} | body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def streamed_calls(chunks: Any) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The calls a stream carried (OpenAI's delta shape: pieces by index), and its finish."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or ():
            if call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_calls_are_valid_and_streamed_alike(api, tool_choice):
    client, _ = api
    request = GREEDY | {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
    request["parallel_tool_calls"] = False
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    calls = calls_of(choice.message)
    # OpenAI's: "tool_calls" where the model chose to call (required), "stop" for a named one.
    finish = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    assert len(calls) == 1 and choice.finish_reason == finish
    name, arguments = calls[0]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    jsonschema.validate(arguments, SCHEMAS[name])
    assert choice.message.content is None
    assert streamed_calls(client.chat.completions.create(**request, stream=True)) == (
        calls,
        finish,
    )


def test_a_tool_answer_goes_back_into_the_next_prompt(api):
    client, _ = api
    first = client.chat.completions.create(
        **GREEDY, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    message = first.choices[0].message
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 21 C"}
    follow = [*MESSAGES, message.model_dump(exclude_none=True), answer]
    tokenized = tokenize(client, {"messages": follow, "tools": TOOLS})
    text = bytes(t for t in tokenized["tokens"] if t < 256).decode()
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    assert json.dumps({"name": calls_of(message)[0][0]}).rstrip("}") in text
    short = GREEDY | {"max_tokens": 4}
    second = client.chat.completions.create(**short, messages=follow, tools=TOOLS)
    assert second.usage.prompt_tokens == len(tokenized["tokens"])


def test_auto_writes_text_when_the_model_calls_nothing(api):
    client, _ = api
    plain = client.chat.completions.create(**GREEDY | {"max_tokens": 12}, messages=MESSAGES)
    auto = client.chat.completions.create(
        **GREEDY | {"max_tokens": 12}, messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    # tool_choice none leaves the tools out of the prompt: the same answer as without them.
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"chat_template": "{{ messages[0].content }}", "tool_choice": "auto"}, "tools"),
        ({"chat_template": "{% for %}"}, "chat_template"),
        ({"structured_outputs": {"regex": "a+", "disable_fallback": True}}, None),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
    ],
)
def test_what_cannot_take_effect_is_a_400_naming_it(api, extra, param):
    client, _ = api
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**GREEDY, messages=MESSAGES, tools=TOOLS, extra_body=extra)
    body = error.value.body
    assert body is not None
    expected = param or "structured_outputs.disable_fallback"
    assert body["param"] == expected and expected.split(".")[-1] in body["message"]


def test_reasoning_is_split_off_by_a_thinking_template(api):
    """A per-request Qwen3.5 template opens a thinking block: the output is reasoning; with
    enable_thinking false it is content. The oracle is the same prompt as a completion."""
    client, _ = api
    tokenizer_prompt = tokenize(client, {"messages": MESSAGES, "chat_template": QWEN3_5})
    plain = client.completions.create(
        model="tiny", prompt=tokenizer_prompt["tokens"], temperature=0.0, max_tokens=16
    )
    extra = {"chat_template": QWEN3_5}
    request = GREEDY | {"max_tokens": 16, "messages": MESSAGES}
    thinking = client.chat.completions.create(**request, extra_body=extra)
    message = thinking.choices[0].message
    assert "</think>" not in plain.choices[0].text  # so all of it is reasoning
    assert message.model_extra["reasoning_content"] == plain.choices[0].text
    assert not message.content
    streamed = "".join(
        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for chunk in client.chat.completions.create(**request, extra_body=extra, stream=True)
    )
    assert streamed == plain.choices[0].text
    hidden = client.chat.completions.create(
        **request, extra_body=extra | {"include_reasoning": False}
    )
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    off = extra | {"chat_template_kwargs": {"enable_thinking": False}}
    answer = client.chat.completions.create(**request, extra_body=off).choices[0].message
    assert answer.content and not (answer.model_extra or {}).get("reasoning_content")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[ab]{3}z"}}, lambda t: re.fullmatch("[ab]{3}z", t)),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
        (
            {"structured_outputs": {"json": {"enum": [{"n": 1}, {"n": 2}]}}},
            lambda t: json.loads(t) in ({"n": 1}, {"n": 2}),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}},
            lambda t: re.fullmatch("x[0-9]{2}", t),
        ),
        ({"regex": "q{2}[0-9]"}, lambda t: re.fullmatch("q{2}[0-9]", t)),
        ({"ebnf": 'root ::= "y" | "n"'}, lambda t: t in ("y", "n")),
        ({"json_schema": json.dumps({"enum": ["A", "B"]})}, lambda t: json.loads(t) in ("A", "B")),
    ],
    ids=["regex", "choice", "json", "grammar", "sglang-regex", "sglang-ebnf", "sglang-json"],
)
def test_structured_outputs_under_todays_names(api, extra, check):
    client, _ = api
    reply = client.completions.create(
        model="tiny", prompt="Answer: ", max_tokens=40, temperature=0.0, extra_body=extra
    )
    assert check(reply.choices[0].text), reply.choices[0].text
