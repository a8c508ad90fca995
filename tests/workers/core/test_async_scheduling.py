"""Async scheduling (`async_scheduling`: step N+1 scheduled and handed to the rank before step
N's tokens are known) against synchronous scheduling, the oracle: the same tokens, logprobs
and finish reasons for a mixed workload (stops learned one step late, lengths, seeded
sampling, prompt scores, n > 1 forks and penalties, which make a step wait), with chunked
prompts and preemption, across turns that reuse snapshots, and through an abort while a step
runs ahead; the pools back at baseline and the rank's tables released every time."""

from __future__ import annotations

import pytest

from hybridserve.workers import Engine, EngineConfig, RequestOutput, SamplingParams
from hybridserve.workers.core.scheduler import Scheduler
from tests.helpers import assert_pools_at_baseline, run_until_idle

SMALL = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 8}
PROMPTS = [list(b"hello world"), list(b"The quick brown fox"), list(b"jumps"), list(b"xyz!")]


def counting_run_ahead(monkeypatch) -> list[int]:
    """Count the steps that ran ahead (so a test of equality knows it compared something)."""
    calls: list[int] = []
    run_ahead = Scheduler.run_ahead

    def counted(self, out):
        calls.append(len(out.scheduled))
        return run_ahead(self, out)

    monkeypatch.setattr(Scheduler, "run_ahead", counted)
    return calls


def workload(stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return [
        (PROMPTS[0], SamplingParams(max_tokens=20, **greedy)),
        (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_token,))),
        (PROMPTS[1], SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=7, logprobs=2)),
        (PROMPTS[2], SamplingParams(max_tokens=14, prompt_logprobs=1, min_tokens=3, **greedy)),
        (PROMPTS[3], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=11, repetition_penalty=1.3, **greedy)),
        (PROMPTS[2], SamplingParams(max_tokens=25, temperature=0.7, ignore_eos=True)),
    ]


def generate(async_scheduling: bool, stop_token: int, **overrides) -> list[RequestOutput]:
    engine = Engine(EngineConfig(**(SMALL | overrides), async_scheduling=async_scheduling))
    ids = [engine.add_request(p, sp) for p, sp in workload(stop_token)]
    finished = run_until_idle(engine)
    assert_pools_at_baseline(engine)
    return [finished[i] for i in sorted(finished, key=lambda i: (ids.index(i.split("#")[0]), i))]


def fields(output: RequestOutput) -> tuple:
    """What must be equal: ids, tokens and why they ended, exactly; logprobs to 1e-5 (a
    batch of other rows may round them differently)."""
    scores = [
        (entry.token_id, round(entry.logprob, 5), [(t, round(lp, 5)) for t, lp in entry.top])
        for entry in [*(output.logprobs or []), *(output.prompt_logprobs or [])]
        if entry is not None
    ]
    return (output.request_id, output.token_ids, output.finish_reason, scores)


@pytest.mark.parametrize(
    "overrides",
    [{"num_kv_blocks": 128}, {"num_kv_blocks": 24, "max_num_batched_tokens": 8}],
    ids=["ample", "preempting-chunked"],
)
def test_async_scheduling_gives_the_tokens_of_synchronous_scheduling(overrides, monkeypatch):
    reference = generate(False, stop_token=0, **overrides)
    stop_token = reference[0].token_ids[6]  # greedy's 7th token: request 1 stops there
    reference = generate(False, stop_token, **overrides)
    assert reference[1].finish_reason == "stop" and len(reference[1].token_ids) <= 7
    ahead = counting_run_ahead(monkeypatch)
    outputs = generate(True, stop_token, **overrides)
    assert [fields(o) for o in outputs] == [fields(o) for o in reference]
    assert len(ahead) > 10  # most steps ran ahead of their tokens


def test_turns_reuse_the_snapshots_of_turns_that_ran_ahead():
    """Turn 2 repeats turn 1's prompt and output and adds to it: it resumes from turn 1's
    turn-end snapshot (taken one token later than synchronous scheduling takes it, after the
    step that ran ahead) and makes the tokens it would make without reuse."""

    def conversation(async_scheduling: bool, enable_prefix_caching: bool) -> list[RequestOutput]:
        engine = Engine(
            EngineConfig(
                **SMALL,
                num_kv_blocks=128,
                async_scheduling=async_scheduling,
                enable_prefix_caching=enable_prefix_caching,
                snapshot_turn_end=True,
            )
        )
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        first = engine.add_request(PROMPTS[1], params)
        turn1 = run_until_idle(engine)[first]
        second = engine.add_request([*PROMPTS[1], *turn1.token_ids, *b" and more"], params)
        turn2 = run_until_idle(engine)[second]
        assert_pools_at_baseline(engine)
        return [turn1, turn2]

    reused = conversation(True, True)
    assert reused[1].num_cached_tokens == len(PROMPTS[1]) + 10  # through turn 1's last token
    assert [o.token_ids for o in reused] == [o.token_ids for o in conversation(False, False)]
    assert [o.token_ids for o in reused] == [o.token_ids for o in conversation(False, True)]


def test_an_abort_while_a_step_runs_ahead_loses_nothing_else(monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def serve(async_scheduling: bool) -> dict[str, RequestOutput]:
        engine = Engine(EngineConfig(**SMALL, num_kv_blocks=128, async_scheduling=async_scheduling))
        for index, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(prompt, params, request_id=f"r{index}")
        for _ in range(5):
            engine.step()
        if async_scheduling:
            assert engine._ahead is not None  # the next step is on the rank already
        aborted = engine.abort("r1")
        assert aborted is not None and aborted.finish_reason == "abort"
        finished = run_until_idle(engine)
        assert_pools_at_baseline(engine)
        return finished

    ahead = counting_run_ahead(monkeypatch)
    outputs = serve(True)
    assert ahead
    reference = serve(False)
    assert {k: fields(v) for k, v in outputs.items()} == {
        k: fields(v) for k, v in reference.items()
    }
    assert set(outputs) == {"r0", "r2"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"tensor_parallel_size": 2},
            "async_scheduling with tensor_parallel_size=2: a step that runs ahead",
        ),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "async_scheduling with speculative_config",
        ),
    ],
)
def test_what_async_scheduling_cannot_serve_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(async_scheduling=True, **overrides)
