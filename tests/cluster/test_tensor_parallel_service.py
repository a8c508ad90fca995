"""Tensor-parallel engines in the service: each is rank actors in its own placement group (here
two decode engines of TP 2 behind a TP 1 prefill engine, speculating). Over HTTP with the
`openai` client they give the offline TP 1 engine's tokens (greedy: the engine without
speculation; sampled: with the same speculation, whose draws are then the same); a rank of
a decode engine killed mid-stream ends that engine's streams with an error, the engine leaves
the router and the index, and the rest keep serving."""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest
import ray

from hybridserve.workers import LLM, SamplingParams
from tests.service import (
    ENGINE,
    PROMPT,
    SPECULATIVE,
    assert_at_baseline,
    client,
    offline_tokens,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", **ENGINE)


def test_each_engine_runs_on_its_own_placement_group_of_rank_actors(tp_service):
    resources = tp_service.coordinator.engine_resources.remote().result()
    assert resources == {
        "prefill-0": {"ranks": 1, "actor_options": {"num_cpus": 0}},
        **{
            name: {"ranks": 2, "bundle": {"CPU": 0.5}, "placement_strategy": "STRICT_PACK"}
            for name in ("decode-0", "decode-1")
        },
    }
    engines = tp_service.engines()
    assert len(ray.get(engines["decode-0"].rank_actors.remote())) == 1
    assert ray.get(engines["prefill-0"].rank_actors.remote()) == []


def test_every_engine_process_gets_the_wait_policy(tp_service):
    """cpu_wait_policy "brief": OpenMP reads GOMP_SPINCOUNT as a process starts, so the
    Coordinator puts it in the engines' runtime environment, which their ranks inherit."""
    engines = tp_service.engines()
    processes = [*engines.values(), *ray.get(engines["decode-0"].rank_actors.remote())]
    waits = ray.get([p.__ray_call__.remote(_wait_variables) for p in processes])
    assert waits == [(None, "2000")] * len(processes)
    assert tp_service.coordinator.cpu_wait_policy.remote().result() == "brief"


def test_a_tensor_parallel_engine_keeps_its_node_unbound(tp_service):
    """cpu_binding "auto": the TP 2 decode engine computes in its rank actors too, so it is
    not bindable, and nothing on its node is bound."""
    placed = {p["name"]: p for p in tp_service.coordinator.cpu_placements.remote().result()}
    assert not placed["decode-0"]["bindable"]
    assert set(tp_service.coordinator.cpu_binding.remote().result().values()) == {None}


def _wait_variables(_actor: object) -> tuple[str | None, str | None]:
    return os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")


def test_completions_and_chat_equal_an_offline_tp1_run(tp_service, offline):
    greedy = client(tp_service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    expected = offline_tokens(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert greedy.choices[0].token_ids == expected
    stream = client(tp_service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        seed=11,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    streamed = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
    with LLM("tiny", speculative_config=SPECULATIVE, **ENGINE) as speculating:
        assert streamed == offline_tokens(
            speculating, PROMPT, max_tokens=10, temperature=0.9, seed=11, ignore_eos=True
        )
    messages = [{"role": "user", "content": "Say something about state space models."}]
    chat = client(tp_service).chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    (expected_chat,) = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0))
    assert chat.choices[0].message.content == expected_chat.text
    drafted = [
        ray.get(engine.stats.remote())["spec_decode_num_draft_tokens"]
        for name, engine in tp_service.engines().items()
        if name.startswith("decode")
    ]
    assert sum(drafted) > 0  # the decode engines verified drafts
    assert_at_baseline(tp_service)


def test_a_stop_string_ends_a_speculating_stream_where_the_text_has_it(tp_service, offline):
    """A verify step may bring several tokens past the stop string: the text still ends
    right before it, as the offline engine's text does."""
    full = offline.tokenizer.decode(
        offline_tokens(offline, PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    )
    stop = full[10:13]
    result = client(tp_service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (result.choices[0].text, result.choices[0].finish_reason) == (
        full[: full.index(stop)],
        "stop",
    )
    assert_at_baseline(tp_service)


def test_a_rank_killed_mid_stream_ends_its_engine_s_streams_and_the_rest_keep_serving(
    tp_service, offline
):
    """Runs last in this module: it kills a rank of one engine, which is restarted. Every
    stream ends: those on the victim with the rank's error, the others with the offline
    engine's tokens."""
    errors: dict[int, str] = {}
    finished: dict[int, list[int]] = {}
    prompts = [f"{PROMPT} ({index})" for index in range(4)]

    def consume(index: int) -> None:
        tokens: list[int] = []
        try:
            stream = client(tp_service).completions.create(
                model="tiny",
                prompt=prompts[index],
                max_tokens=600,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for chunk in stream:
                for choice in chunk.choices:
                    tokens += choice.model_extra.get("token_ids") or []
            finished[index] = tokens
        except openai.APIError as exc:
            errors[index] = str(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    engines = tp_service.engines()
    victim = "decode-0"
    deadline = time.monotonic() + 30
    while not ray.get(engines[victim].stats.remote())["num_requests_running"]:
        assert time.monotonic() < deadline, "no request reached the victim engine"
        time.sleep(0.05)
    (rank_actor,) = ray.get(engines[victim].rank_actors.remote())
    ray.kill(rank_actor)
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a stream never ended"
    assert sorted([*errors, *finished]) == [0, 1, 2, 3]
    assert errors and all("tensor-parallel rank 1 died" in e for e in errors.values()), errors
    for index, tokens in finished.items():
        expected = offline_tokens(
            offline, prompts[index], max_tokens=600, temperature=0, ignore_eos=True
        )
        assert tokens == expected, index
    # The engine is dropped (its index entries and its placement group go) and restarted: a
    # new incarnation with two new ranks in a new placement group.
    deadline = time.monotonic() + 90
    while tp_service.topology()["incarnations"].get(victim) != 1:
        assert time.monotonic() < deadline, "the dead engine was never restarted"
        time.sleep(0.2)
    router = tp_service.topology()["router"]
    assert victim in ray.get(router.stats.remote())["engines"]
    restarted = tp_service.engines()[victim]
    assert len(ray.get(restarted.rank_actors.remote())) == 1
    probe = client(tp_service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert probe.choices[0].model_extra["token_ids"] == offline_tokens(
        offline, PROMPT, max_tokens=3, temperature=0, ignore_eos=True
    )
    assert_at_baseline(tp_service)
