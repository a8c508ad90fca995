"""The OpenAI parameters that change an answer, over real HTTP with the `openai` client.

Oracles: an offline `LLM` of the same model for logprobs (its log-softmax over the whole
vocabulary) and for penalised sampling; separate seeded requests for n > 1 choices; the JSON
schema itself for structured output. Each parameter runs on both deployment shapes: one
colocated engine, and 1 prefill + 2 decode engines (the prompt is computed on the prefill
engine and handed off); the engines' counters show which ran the prompt.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import ray
import torch

from hybridserve.workers import LLM, SamplingParams
from tests.helpers import PERSON_SCHEMA, engine_logprobs
from tests.service import API_KEY, ENGINE, Service, assert_at_baseline, client

pytestmark = pytest.mark.slow

PROMPT_IDS = list(range(30, 130))
SALTS = (f"openai-api-{i}" for i in itertools.count())


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", max_logprobs=-1, **ENGINE)


def counters(service: Service) -> dict[str, dict[str, Any]]:
    engines = service.engines()
    return dict(zip(engines, ray.get([h.stats.remote() for h in engines.values()]), strict=True))


def counted(before: dict, after: dict, key: str) -> dict[str, int]:
    """Each engine's growth of counter `key` (engines that did not move are left out)."""
    grown = {name: after[name][key] - before[name][key] for name in after}
    return {name: n for name, n in grown.items() if n}


def token_id(token: str) -> int:
    """A token shown with return_tokens_as_token_ids ("token_id:<id>")."""
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def shape(grown: dict[str, int]) -> str:
    """Where the prompt was computed: the prefill engine (then handed off) or a decode one."""
    assert len(grown) == 1, grown
    (name,) = grown
    return "disaggregated" if name.startswith("prefill-") else "colocated"


# ---- logprobs ---------------------------------------------------------------------------------


def test_completion_logprobs_with_echo_equal_the_offline_log_softmax(deployment, offline):
    before = counters(deployment)
    result = client(deployment).completions.create(
        model="tiny",
        prompt=PROMPT_IDS,
        max_tokens=4,
        temperature=0,
        logprobs=5,
        echo=True,
        extra_body={
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
            "cache_salt": next(SALTS),
        },
    )
    grown = counted(before, counters(deployment), "num_prompt_tokens_computed")
    assert shape(grown) == deployment.shape
    (choice,) = result.choices
    ids = [*PROMPT_IDS, *choice.token_ids]
    (table,) = engine_logprobs(offline, [ids])  # row i: the distribution of token i + 1
    logprobs = choice.logprobs
    assert [token_id(t) for t in logprobs.tokens] == ids
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(ids)):
        row = table[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(
            row[ids[position]].item(), abs=1e-4
        )
        top = logprobs.top_logprobs[position]
        expected_top = torch.topk(row, 5)
        assert len(top) == 5
        assert sorted(top.values(), reverse=True) == pytest.approx(
            expected_top.values.tolist(), abs=1e-4
        )
    # The generated tokens are the greedy ones: each is its row's most likely token.
    for position in range(len(PROMPT_IDS), len(ids)):
        assert ids[position] == int(table[position - 1].argmax())
    assert logprobs.text_offset == list(range(len(ids)))  # token_id:<id> forms, byte tokens
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT_IDS), 4)
    assert_at_baseline(deployment)


def test_a_scoring_request_returns_the_prompt_and_its_logprobs_only(service, offline):
    """What evaluation harnesses send: echo, max_tokens 0 and logprobs."""
    text = "The capital of France is Paris."
    result = client(service).completions.create(
        model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = result.choices
    ids = list(text.encode())  # the tiny tokenizer: one token per byte
    (table,) = engine_logprobs(offline, [ids])
    assert choice.text == text
    assert "".join(choice.logprobs.tokens) == text
    assert choice.logprobs.text_offset == list(range(len(ids)))
    assert choice.logprobs.token_logprobs[0] is None
    expected = [table[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 0)
    assert_at_baseline(service)


def test_chat_logprobs_have_openai_s_shape_streamed_or_not(service, offline):
    messages = [{"role": "user", "content": "Name a hybrid model."}]
    params = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"return_token_ids": True, "ignore_eos": True},
    }
    whole = client(service).chat.completions.create(**params)
    content = whole.choices[0].logprobs.content
    generated = whole.choices[0].token_ids
    assert len(content) == len(generated) == 5
    (table,) = engine_logprobs(offline, [[*whole.prompt_token_ids, *generated]])
    start = len(whole.prompt_token_ids)
    for position, entry in enumerate(content):
        row = table[start + position - 1]
        assert entry.logprob == pytest.approx(row[generated[position]].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(row, 3).values.tolist(), abs=1e-4
        )
    streamed = [
        entry
        for chunk in client(service).chat.completions.create(**params, stream=True)
        for c in chunk.choices
        if c.logprobs is not None
        for entry in c.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert_at_baseline(service)


# ---- n > 1 ------------------------------------------------------------------------------------


def test_n_choices_fork_from_one_prefill_and_equal_separate_seeded_requests(deployment):
    params = {
        "model": "tiny",
        "prompt": PROMPT_IDS,
        "max_tokens": 8,
        "temperature": 1.0,
    }
    before = counters(deployment)
    result = client(deployment).completions.create(
        **params,
        n=4,
        seed=11,
        extra_body={"return_token_ids": True, "ignore_eos": True, "cache_salt": next(SALTS)},
    )
    after = counters(deployment)
    # One prefill: the prompt ran through the model once, on one engine; 3 choices forked.
    computed = counted(before, after, "num_prompt_tokens_computed")
    assert list(computed.values()) == [len(PROMPT_IDS)]
    assert shape(computed) == deployment.shape
    assert sum(counted(before, after, "num_forks").values()) == 3
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT_IDS), 32)
    separate = [
        client(deployment)
        .completions.create(
            **params,
            seed=11 + i,
            extra_body={"return_token_ids": True, "ignore_eos": True, "cache_salt": next(SALTS)},
        )
        .choices[0]
        .token_ids
        for i in range(4)
    ]
    assert [c.token_ids for c in result.choices] == separate
    assert len({tuple(t) for t in separate}) > 1  # the seeds do differ
    assert_at_baseline(deployment)


def test_n_choices_stream_interleaved_by_index(service):
    params = {
        "model": "tiny",
        "prompt": PROMPT_IDS,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client(service).completions.create(**params)
    texts, finished, indices = ["", "", ""], {}, []
    stream = client(service).completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            indices.append(c.index)
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert set(indices) == {0, 1, 2}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT_IDS), 18)
    assert_at_baseline(service)


# ---- sampling controls ------------------------------------------------------------------------


def test_penalties_and_min_p_sample_as_the_offline_engine(deployment, offline):
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    extra = {"repetition_penalty": 1.4, "min_p": 0.05, "ignore_eos": True}
    result = client(deployment).completions.create(
        model="tiny",
        prompt=PROMPT_IDS,
        max_tokens=24,
        temperature=0.8,
        seed=3,
        **penalties,
        extra_body={**extra, "return_token_ids": True},
    )
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, **penalties, **extra)
    (expected,) = offline.generate([PROMPT_IDS], params, use_tqdm=False)
    assert result.choices[0].token_ids == expected.token_ids
    plain = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    (unpenalised,) = offline.generate([PROMPT_IDS], plain, use_tqdm=False)
    assert expected.token_ids != unpenalised.token_ids  # the penalties changed the draw
    assert_at_baseline(deployment)


def test_logit_bias_forces_or_bans_a_token(deployment):
    def tokens(bias: dict[str, int], temperature: float) -> list[int]:
        result = client(deployment).completions.create(
            model="tiny",
            prompt=PROMPT_IDS,
            max_tokens=6,
            temperature=temperature,
            seed=1,
            logit_bias=bias,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return result.choices[0].token_ids

    assert tokens({"65": 100}, temperature=1.0) == [65] * 6
    greedy = tokens({}, temperature=0)
    banned = tokens({str(greedy[0]): -100}, temperature=0)
    assert banned[0] != greedy[0]
    assert_at_baseline(deployment)


# ---- structured output ------------------------------------------------------------------------


def test_json_schema_output_parses_and_validates(deployment):
    text = "".join(chr(t) for t in PROMPT_IDS)
    for seed in (1, 2):
        result = client(deployment).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            },
        )
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    assert_at_baseline(deployment)


def test_json_object_regex_and_choice_constraints(service):
    def complete(**extra: Any) -> str:
        result = client(service).completions.create(
            model="tiny", prompt=PROMPT_IDS, max_tokens=60, temperature=1.0, seed=4, **extra
        )
        assert result.choices[0].finish_reason == "stop"
        return result.choices[0].text

    assert isinstance(
        json.loads(complete(extra_body={"response_format": {"type": "json_object"}})), dict
    )
    code = complete(extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert len(code) == 6 and code[:3].isalpha() and code[3] == "-" and code[4:].isdigit()
    assert complete(extra_body={"guided_choice": ["yes", "no", "maybe"]}) in {"yes", "no", "maybe"}
    assert_at_baseline(service)


# ---- refused and hostile chat bodies ----------------------------------------------------------

BAD_CHATS = [
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    # A request's own template is code: refused unless trust_request_chat_template.
    ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"response_format": {"type": "text_or_else"}}, "response_format.type"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_refused_chat_parameters_are_400_naming_them(service, change, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | change
    response = httpx.post(
        f"{service.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    ok = client(service).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert_at_baseline(service)


# Parameters that peers read and this service does not: each is a 400 naming it, not a 200
# that ignores it (tests/cluster/openai/test_known_parameters.py walks every known one).
NOT_SERVED = [
    ("completions", "thinking_token_budget", 64),
    ("chat", "thinking_token_budget", 64),
    ("completions", "include_reasoning", False),
]


@pytest.mark.parametrize(("route", "param", "value"), NOT_SERVED)
def test_parameters_not_served_are_400_naming_them(service, route, param, value):
    """Through the official client (`extra_body`), as users send them."""
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client(service).completions.create(
                model="tiny", prompt="hi", max_tokens=2, extra_body={param: value}
            )
        else:
            client(service).chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={param: value},
            )
    error = refused.value.body
    assert error["param"] == param and param in error["message"], error
    assert_at_baseline(service)


# ---- no engine left (runs last: it kills the colocated deployment's only engine) -------------


def test_zz_with_no_engine_left_answers_are_openai_errors(colocated_service, service):
    (engine,) = colocated_service.engines().values()
    ray.kill(engine, no_restart=True)
    url = f"{colocated_service.base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    for _ in range(2):  # the request that finds the engine dead, then one with none left
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code >= 500, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    with httpx.stream(
        "POST", url, json=body | {"stream": True}, headers=headers, timeout=60
    ) as response:
        raw = response.read().decode()
    if response.status_code == 200:  # the failure came once the stream had started
        events = [line for line in raw.split("\n\n") if line]
        assert len(events) == 1 and events[0].startswith('data: {"error":'), raw
        assert "[DONE]" not in raw
    else:
        assert response.status_code >= 500 and "error" in json.loads(raw), raw
    # The other deployment keeps serving.
    ok = client(service).completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
