"""Several prompts in one /v1/completions request, and vLLM's /tokenize and /detokenize, over
HTTP (tests/cluster/openai/local_api.py). Oracle: each prompt sent alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.openai.local_api import local_api, local_client
from tests.helpers import assert_pools_at_baseline

PROMPTS = ["The first prompt", [40, 41, 42, 43, 44], "A third, longer prompt than the others"]
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[openai.OpenAI, str, Any]]:
    engine = {"max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 512}
    with local_api(engine=engine) as (url, host):
        yield local_client(url), url.removesuffix("/v1"), host


@pytest.fixture(autouse=True)
def at_baseline(api):
    yield
    assert_pools_at_baseline(api[2].engine)


def alone(client: openai.OpenAI, prompt: Any, **params: Any) -> list[str]:
    reply = client.completions.create(**(GREEDY | params), prompt=prompt)
    return [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("n", [1, 2])
def test_a_batch_answers_each_prompt_as_if_alone(api, n):
    client, _, _ = api
    params = {"n": n, "seed": 3, "temperature": 0.8}
    reply = client.completions.create(**(GREEDY | params), prompt=PROMPTS)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts == [t for p in PROMPTS for t in alone(client, p, **params)]
    assert reply.usage.completion_tokens == 6 * n * len(PROMPTS)
    singles = [client.completions.create(**GREEDY, prompt=p).usage.prompt_tokens for p in PROMPTS]
    assert reply.usage.prompt_tokens == sum(singles)


def test_a_streamed_batch_interleaves_its_prompts_under_their_indexes(api):
    client, _, _ = api
    texts = [""] * len(PROMPTS)
    finished = set()
    for chunk in client.completions.create(**GREEDY, prompt=PROMPTS, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [alone(client, p)[0] for p in PROMPTS]
    assert finished == set(range(len(PROMPTS)))


def test_a_bad_prompt_in_a_batch_refuses_the_whole_request(api):
    client, _, _ = api
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(**GREEDY, prompt=[[1, 2], [3, 99999]])


def test_tokenize_and_detokenize(api):
    client, root, _ = api
    text = "Hello, tokens"
    tokens = httpx.post(f"{root}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert tokens["tokens"] == list(text.encode())  # the tiny tokenizer: bytes
    assert tokens["count"] == len(text) and tokens["max_model_len"] == 512
    back = httpx.post(f"{root}/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    chat = httpx.post(
        f"{root}/tokenize",
        json={"model": "tiny", "messages": [{"role": "user", "content": text}]},
    ).json()
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=1
    )
    assert chat["count"] == reply.usage.prompt_tokens
    bad = httpx.post(f"{root}/detokenize", json={"model": "tiny", "tokens": [1, 5000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_are_returned_wherever_asked_for(api, route):
    """Without echo too: on each choice for completions, on the response for chat (vLLM's
    places). Oracle: the same prompt scored with echo."""
    client, _, _ = api
    prompt_ids = [40, 41, 42, 43, 44, 45]
    echoed = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=1, echo=True, logprobs=2
    )
    expected = echoed.choices[0].logprobs.token_logprobs[: len(prompt_ids)]
    if route == "completions":
        for stream in (False, True):
            reply = client.completions.create(
                model="tiny",
                prompt=prompt_ids,
                max_tokens=2,
                stream=stream,
                extra_body={"prompt_logprobs": 2},
            )
            first, *_ = reply if stream else [reply]  # a stream is read to its end
            entries = first.choices[0].model_extra["prompt_logprobs"]
            assert entries[0] is None and len(entries) == len(prompt_ids)
            pairs = zip(prompt_ids[1:], entries[1:], strict=True)
            got = [None] + [entry[str(token)]["logprob"] for token, entry in pairs]
            assert got == pytest.approx(expected, abs=1e-5)
    else:
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"prompt_logprobs": 1},
        )
        entries = reply.model_extra["prompt_logprobs"]
        assert entries[0] is None and all(len(e) <= 2 for e in entries[1:])
        assert len(entries) == reply.usage.prompt_tokens
