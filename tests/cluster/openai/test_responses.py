"""POST /v1/responses through the `openai` client (tests/cluster/openai/local_api.py).

Oracle: the same conversation as a chat completion (the Responses API is served as one), and
the stream's own final response for its deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.cluster.openai.local_api import local_api, local_client
from tests.helpers import assert_pools_at_baseline

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_output_tokens": 10}
ENGINE = {"max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 1024}


KEYS = ["key-a", "key-b"]  # two tenants


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[openai.OpenAI, Any]]:
    with local_api(engine=ENGINE, responses_store_size=2, api_keys=KEYS) as (url, host):
        yield local_client(url, KEYS[0]), host


@pytest.fixture(autouse=True)
def at_baseline(api):
    yield
    assert_pools_at_baseline(api[1].engine)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 10) -> str:
    reply = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0.0, max_tokens=max_tokens
    )
    return reply.choices[0].message.content or ""


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude={"id"}) for item in items]


def test_a_response_is_the_chat_completion_of_its_input(api):
    client, _ = api
    reply = client.responses.create(**GREEDY, input="Hello there", instructions="Be brief.")
    expected = chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )
    assert reply.output_text == expected and expected
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 10
    assert client.responses.retrieve(reply.id).output_text == expected


def test_the_stream_carries_the_same_response(api):
    client, _ = api
    whole = client.responses.create(**GREEDY, input="Stream this")
    events = list(client.responses.create(**GREEDY, input="Stream this", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert without_ids(final.output) == without_ids(whole.output)
    assert final.usage == whole.usage


def test_previous_response_id_continues_the_conversation_from_its_snapshot(api):
    client, _ = api
    first = client.responses.create(**GREEDY, input="Tell me about Mamba layers in one line.")
    second = client.responses.create(
        **GREEDY, input="And attention?", previous_response_id=first.id
    )
    conversation = [
        {"role": "user", "content": "Tell me about Mamba layers in one line."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And attention?"},
    ]
    assert second.output_text == chat_text(client, conversation)
    # The first turn's state was reused: its prompt and answer were not computed again.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_function_calls_and_their_outputs(api):
    client, _ = api
    request = GREEDY | {"max_output_tokens": 80, "tools": TOOLS, "tool_choice": "required"}
    called = client.responses.create(**request, input="Weather?", parallel_tool_calls=False)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    streamed = list(
        client.responses.create(**request, input="Weather?", parallel_tool_calls=False, stream=True)
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    final = streamed[-1].response.output
    assert [(o.type, o.name, o.arguments) for o in final] == [
        ("function_call", call.name, call.arguments)
    ]

    answered = client.responses.create(
        **GREEDY,
        tools=TOOLS,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    tool_call = {"name": call.name, "arguments": call.arguments}
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": tool_call}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    expected = client.chat.completions.create(
        model="tiny",
        messages=conversation,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
        temperature=0.0,
        max_tokens=10,
    )
    assert answered.output_text == expected.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
        ({"background": True}, 400, "background"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"truncation": "auto"}, 400, "truncation"),
    ],
)
def test_what_is_not_served_is_refused_by_name(api, extra, status, param):
    client, _ = api
    with pytest.raises(openai.APIStatusError) as error:
        client.responses.create(**(GREEDY | {"input": "hi"} | extra))
    assert error.value.status_code == status
    assert error.value.body["param"] == param


def test_the_store_keeps_the_newest_responses(api):
    client, _ = api
    ids = [client.responses.create(**GREEDY, input=f"turn {i}").id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the store holds 2 here
    client.responses.delete(ids[2])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[2])
    assert client.responses.retrieve(ids[1]).id == ids[1]
    unstored = client.responses.create(**GREEDY, input="not kept", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_response_is_its_tenant_s_only(api):
    client, _ = api
    stored = client.responses.create(**GREEDY, input="mine")
    other = local_client(str(client.base_url), KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(**GREEDY, input="and?", previous_response_id=stored.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(stored.id)
    assert client.responses.retrieve(stored.id).id == stored.id


def test_a_response_without_text_continues_as_an_empty_turn():
    """Cut while reasoning, a response has no message: the conversation it continues from
    still holds a valid assistant turn."""
    from hybridserve.cluster.openai.protocol import ChatMessage
    from hybridserve.cluster.openai.responses_api import ResponsesRequest, ResponseState

    state = ResponseState(ResponsesRequest.model_validate({"input": "hi"}))
    message = state.assistant_message()
    assert ChatMessage.model_validate(message).content == ""
