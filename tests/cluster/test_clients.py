"""Clients people point at OpenAI-compatible servers, run unchanged against the service:
lm-evaluation-harness (loglikelihood through `local-completions` in batches of 4 prompts,
generate_until through `local-chat-completions`), LangChain's `ChatOpenAI` (invoke, stream,
structured output, tools), the OpenAI Agents SDK (a tool-using agent over chat completions and
over the Responses API) and GuideLLM (a load generator). Oracles: the offline engine of the
same model, and the tools' schemas.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.models.tiny import write_tiny_checkpoint
from tests.helpers import engine_logprobs
from tests.service import API_KEY, ENGINE, assert_at_baseline

pytestmark = pytest.mark.slow

QUESTIONS = [
    {"question": "Mamba layers keep a", "choices": [" state", " cat", " moon"], "answer": 0},
    {"question": "Attention layers keep a", "choices": [" KV cache", " dog"], "answer": 0},
    {"question": "The hybrid model is", "choices": [" fast", " slow", " blue"], "answer": 1},
]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", max_logprobs=-1, **ENGINE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as an HF folder: the clients load its tokenizer from there."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def write_tasks(folder: Path) -> Path:
    """Two lm-eval tasks over a local JSON file: multiple choice (loglikelihood) and
    generate_until."""
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{question}}}}"
    """
    (folder / "hybridserve_choice.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: hybridserve_choice
        output_type: multiple_choice
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
    """)
    )
    (folder / "hybridserve_generate.yaml").write_text(
        textwrap.dedent(common)
        + textwrap.dedent("""
        task: hybridserve_generate
        output_type: generate_until
        doc_to_target: "{{choices[answer]}}"
        generation_kwargs:
          until: ["<never>"]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
    """)
    )
    return folder


def test_lm_eval_scores_and_generates_through_the_api(
    service, offline, checkpoint, tmp_path, monkeypatch
):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    tasks = TaskManager(include_path=str(write_tasks(tmp_path)))
    scored = simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={service.base_url}/v1/completions,model=tiny,tokenizer={checkpoint},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,batch_size=4"
        ),
        tasks=["hybridserve_choice"],
        task_manager=tasks,
        log_samples=True,
    )
    samples = scored["samples"]["hybridserve_choice"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample in samples:
        expected_lls = []
        for (context, continuation), ((loglikelihood, _greedy),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            ids = list((context + continuation).encode())  # the tiny tokenizer: bytes
            (table,) = engine_logprobs(offline, [ids])
            start = len(context.encode())
            expected = sum(table[i - 1, ids[i]].item() for i in range(start, len(ids)))
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
            expected_lls.append(expected)
        # lm-eval picks the choice of the highest log-likelihood.
        correct += max(range(len(expected_lls)), key=expected_lls.__getitem__) == sample["target"]
    assert scored["results"]["hybridserve_choice"]["acc,none"] == correct / len(samples)

    generated = simple_evaluate(
        model="local-chat-completions",
        model_args=f"base_url={service.base_url}/v1/chat/completions,model=tiny,max_retries=1",
        tasks=["hybridserve_generate"],
        task_manager=tasks,
        apply_chat_template=True,
        log_samples=True,
    )
    samples = generated["samples"]["hybridserve_generate"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        (response,) = sample["resps"][0]
        messages = [{"role": "user", "content": sample["doc"]["question"]}]
        (expected,) = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0))
        assert response == expected.text and response
    assert_at_baseline(service)


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


def test_langchain_chat_openai_invokes_streams_and_structures(service, offline):
    from langchain_openai import ChatOpenAI

    def chat_model(**params: Any) -> ChatOpenAI:
        return ChatOpenAI(
            model="tiny",
            base_url=f"{service.base_url}/v1",
            api_key=API_KEY,
            max_retries=0,
            **params,
        )

    chat = chat_model(temperature=0, max_tokens=8)
    question = "What does a Mamba layer keep?"
    (expected,) = offline.chat(
        [{"role": "user", "content": question}], SamplingParams(max_tokens=8, temperature=0)
    )
    reply = chat.invoke(question)
    assert reply.content == expected.text and reply.content
    assert reply.usage_metadata["output_tokens"] == len(expected.token_ids)
    assert "".join(chunk.content for chunk in chat.stream(question)) == expected.text

    structured = chat_model(temperature=1.0, seed=7, max_tokens=80).with_structured_output(
        Person, method="json_schema"
    )
    person = structured.invoke("Describe a person as JSON.")
    assert isinstance(person, Person)
    assert_at_baseline(service)


class Sky(BaseModel):
    sky: Literal["sunny", "rainy"]


WEATHER_ARGS = {"city"}


def test_langchain_binds_tools_and_round_trips_a_call(service):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    cities: list[str] = []

    class City(BaseModel):
        city: str = Field(max_length=8)

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    chat = ChatOpenAI(
        model="tiny",
        base_url=f"{service.base_url}/v1",
        api_key=API_KEY,
        max_retries=0,
        temperature=0,
        max_tokens=60,
    )
    forced = chat.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    question = HumanMessage("What is the weather in Paris?")
    called = forced.invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == WEATHER_ARGS
    streamed = None
    for chunk in forced.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

    answer = get_weather.invoke(call)  # a ToolMessage answering the call
    assert cities == [call["args"]["city"]]
    final = chat.bind_tools([get_weather]).invoke([question, called, answer])
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    assert_at_baseline(service)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_openai_agent_calls_its_tool_and_answers(service, api):
    """The Agents SDK's loop: the first turn must call the tool (tool_choice required), the SDK
    runs it and sends its output back, then the agent answers in its output type."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    cities: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    async def run() -> tuple[Any, Any]:
        client = AsyncOpenAI(base_url=f"{service.base_url}/v1", api_key=API_KEY, max_retries=0)
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        agent = Agent(
            name="forecaster",
            instructions="Look the weather up, then answer.",
            tools=[get_weather],
            output_type=Sky,
            model=model_class("tiny", client),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0
            ),
        )
        result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
        streamed = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    result, streamed = asyncio.run(run())
    assert isinstance(result.final_output, Sky) and isinstance(streamed.final_output, Sky)
    assert len(cities) == 2 and cities[0] == cities[1]  # greedy: the same call both times
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert_at_baseline(service)


def test_guidellm_benchmarks_the_service(service, checkpoint, tmp_path):
    report = tmp_path / "guidellm.json"
    backend = f"kind=openai_http,target={service.base_url},model=tiny,api_key={API_KEY}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--backend",
            backend,
            "--profile",
            "kind=concurrent,streams=2",
            "--constraint",
            "kind=max_requests,count=8",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
            "--tokenizer",
            f"kind=huggingface_auto,model={checkpoint}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        check=True,
        timeout=600,
    )
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    # GuideLLM records a failed request in its report instead of failing: every one must
    # have succeeded, with the output length asked for.
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}, totals
    assert_at_baseline(service)
