"""The engine end to end on the built-in `tiny` model: validation, preemption, abort, stopping,
seeded sampling, length caps, prompt logprobs, n > 1 choices and config errors."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve.workers import LLM, Engine, EngineConfig, SamplingParams
from hybridserve.workers.core.step_plan import SamplingRow
from hybridserve.workers.models.tiny import write_tiny_checkpoint
from tests.helpers import assert_pools_at_baseline, engine_logprobs, run_until_idle

# Small pools keep engine start-up cheap (the default CPU KV pool is 1 GiB).
SMALL = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(b"hello world"), list(b"The quick brown fox"), [257, *b"user\nhi", 258]]
VOCAB = 259


def make_engine(**overrides) -> Engine:
    return Engine(EngineConfig(**(SMALL | overrides)))


def generate_alone(prompt: list[int], params: SamplingParams, **overrides) -> list[int]:
    engine = make_engine(**overrides)
    request_id = engine.add_request(prompt, params)
    return run_until_idle(engine)[request_id].token_ids


@pytest.fixture(scope="module")
def greedy_tokens() -> list[list[int]]:
    llm = LLM("tiny", **SMALL)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """An index whose token did not occur before it, so stopping on it stops exactly there."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# ---- validation ---------------------------------------------------------------------------

BAD_REQUESTS = {
    "too long": ([1] * 33, lambda: GREEDY, "the prompt has 33 tokens, more than max_model_len=32"),
    "id too large": (
        [1, VOCAB],
        lambda: GREEDY,
        r"token id 259 is outside the vocabulary \[0, 259\)",
    ),
    "negative id": ([5, -1], lambda: GREEDY, r"token id -1 is outside the vocabulary"),
    "float id": ([5, 2.0], lambda: GREEDY, r"token id 2.0 is outside the vocabulary"),
    "bool id": ([True], lambda: GREEDY, r"token id True is outside the vocabulary"),
    "empty ids": ([], lambda: GREEDY, "the prompt is empty"),
    "empty text": ("", lambda: GREEDY, "the prompt is empty"),
    "max_tokens=0": ([1, 2], lambda: SamplingParams(max_tokens=0), "max_tokens"),
    "temperature<0": ([1, 2], lambda: SamplingParams(temperature=-1), "temperature"),
    "top_p=0": ([1, 2], lambda: SamplingParams(top_p=0.0), "top_p"),
    "min>max": (
        [1, 2],
        lambda: SamplingParams(max_tokens=2, min_tokens=3),
        r"min_tokens \(3\) must not exceed max_tokens \(2\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_raises_before_anything_changes_and_others_keep_running(case):
    prompt, params, message = BAD_REQUESTS[case]
    good_params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = generate_alone(PROMPTS[0], good_params, max_model_len=32)

    engine = make_engine(max_model_len=32)
    engine.add_request(PROMPTS[0], good_params, request_id="good")
    for _ in range(3):
        engine.step()

    def state():
        cache, scheduler = engine.cache, engine.scheduler
        return (
            cache.num_free_blocks,
            cache.num_free_slots,
            [r.request_id for r in scheduler.waiting],
            [(r.request_id, r.num_computed_tokens) for r in scheduler.running],
        )

    before = state()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params(), request_id="bad")
    assert state() == before
    # Nothing was registered under the rejected id.
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="bad")
    finished = run_until_idle(engine)
    assert finished["good"].token_ids == expected
    assert finished["good"].finish_reason == "length"
    assert len(finished["bad"].token_ids) == 2
    assert_pools_at_baseline(engine)


def test_a_duplicate_request_id_is_rejected_while_the_first_runs():
    engine = make_engine()
    engine.add_request(PROMPTS[0], GREEDY, request_id="r")
    engine.step()
    free = (engine.cache.num_free_blocks, engine.cache.num_free_slots)
    with pytest.raises(ValueError, match="request id 'r' is already in use"):
        engine.add_request(PROMPTS[1], GREEDY, request_id="r")
    assert (engine.cache.num_free_blocks, engine.cache.num_free_slots) == free
    assert run_until_idle(engine)["r"].prompt_token_ids == PROMPTS[0]
    # Once finished, the id may be used again.
    engine.add_request(PROMPTS[1], GREEDY, request_id="r")
    assert run_until_idle(engine)["r"].prompt_token_ids == PROMPTS[1]


def test_generated_request_ids_skip_ids_the_caller_already_uses():
    engine = make_engine()
    engine.add_request(PROMPTS[0], GREEDY, request_id="req-0")
    generated = engine.add_request(PROMPTS[1], GREEDY)
    assert generated != "req-0"
    finished = run_until_idle(engine)
    assert sorted(finished) == sorted(["req-0", generated])


# ---- preemption ---------------------------------------------------------------------------

PREEMPTION_PROMPTS = [list(b"abcde"), list(b"preempted"), list(b"xyz"), list(b"seven..")]


def preemption_params(kind: str) -> list[SamplingParams]:
    common = {"max_tokens": 20, "ignore_eos": True}
    if kind == "greedy":
        return [SamplingParams(temperature=0.0, **common)] * 4
    if kind == "seeded":
        return [SamplingParams(temperature=0.8, seed=100 + i, **common) for i in range(4)]
    return [SamplingParams(temperature=0.8, **common)] * 4  # seeds from engine seed + request id


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 6])
@pytest.mark.parametrize("kind", ["greedy", "seeded", "engine-seeded"])
def test_preempted_requests_produce_the_same_tokens_as_with_an_ample_pool(
    kind, max_num_batched_tokens
):
    params = preemption_params(kind)

    def generate(num_kv_blocks: int) -> tuple[list[list[int]], int]:
        engine = make_engine(
            max_model_len=32,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        ids = [engine.add_request(p, sp) for p, sp in zip(PREEMPTION_PROMPTS, params, strict=True)]
        requests = list(engine.scheduler.waiting)
        finished = run_until_idle(engine)
        assert all(finished[i].finish_reason == "length" for i in ids)
        assert_pools_at_baseline(engine)
        return [finished[i].token_ids for i in ids], sum(r.num_preemptions for r in requests)

    # Each request reaches 23-29 tokens = 6-8 blocks of 4; 10 blocks hold barely one at a time.
    tight, num_preemptions = generate(num_kv_blocks=10)
    ample, no_preemptions = generate(num_kv_blocks=64)
    assert num_preemptions > 0
    assert no_preemptions == 0
    assert tight == ample
    assert all(len(t) == 20 for t in tight)
    if kind != "greedy":
        greedy = generate_alone(PREEMPTION_PROMPTS[0], preemption_params("greedy")[0])
        assert ample[0] != greedy  # the sampled runs really sampled


# ---- abort --------------------------------------------------------------------------------


def test_abort_a_running_and_a_waiting_request(greedy_tokens):
    engine = make_engine(max_num_seqs=1)
    running = engine.add_request(PROMPTS[0], GREEDY)
    waiting = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == [waiting]

    output = engine.abort(waiting)
    assert (output.request_id, output.finish_reason, output.token_ids) == (waiting, "abort", [])
    assert list(engine.scheduler.waiting) == []

    output = engine.abort(running)
    assert output.finish_reason == "abort"
    assert output.token_ids == greedy_tokens[0][:2]  # what it had generated so far
    assert not engine.has_unfinished_requests()
    assert_pools_at_baseline(engine)

    assert engine.abort(running) is None  # already gone
    assert engine.abort("never-added") is None
    assert engine.step() == []

    # The engine keeps working afterwards.
    again = engine.add_request(PROMPTS[1], GREEDY)
    assert run_until_idle(engine)[again].token_ids == greedy_tokens[1]


def test_abort_a_preempted_request_frees_everything():
    engine = make_engine(max_model_len=32, num_kv_blocks=10)
    params = preemption_params("greedy")
    ids = [engine.add_request(p, sp) for p, sp in zip(PREEMPTION_PROMPTS, params, strict=True)]
    requests = list(engine.scheduler.waiting)
    while not any(r.num_preemptions for r in requests):
        engine.step()
    victim = next(r for r in requests if r.num_preemptions)
    assert engine.abort(victim.request_id).finish_reason == "abort"
    finished = run_until_idle(engine)
    assert sorted(finished) == sorted(i for i in ids if i != victim.request_id)
    assert_pools_at_baseline(engine)


# ---- stopping -----------------------------------------------------------------------------


def test_stop_token_ids_end_the_request_on_that_token(greedy_tokens):
    tokens = greedy_tokens[0]
    index = first_new_token_index(tokens)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(tokens[index],))
    llm = LLM("tiny", **SMALL)
    (output,) = llm.generate([PROMPTS[0]], params)
    assert output.token_ids == tokens[: index + 1]
    assert output.finish_reason == "stop"
    assert output.text == llm.tokenizer.decode(tokens[: index + 1])
    assert_pools_at_baseline(llm.engine)


def test_min_tokens_suppresses_stop_tokens_until_reached(greedy_tokens):
    tokens = greedy_tokens[0]
    index = first_new_token_index(tokens)
    stop = tokens[index]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_tokens=index + 1
    )
    llm = LLM("tiny", **SMALL)
    (output,) = llm.generate([PROMPTS[0]], params)
    out = output.token_ids
    assert out[:index] == tokens[:index]
    assert stop not in out[: index + 1]
    # At the banned position greedy takes the best token other than the stop token.
    (logits,) = engine_logprobs(
        LLM("tiny", max_logprobs=-1, **SMALL), [PROMPTS[0] + tokens[:index]]
    )
    last = logits[-1].clone()
    last[stop] = float("-inf")
    assert out[index] == int(last.argmax())
    if output.finish_reason == "stop":
        assert out[-1] == stop and len(out) > index + 1
    else:
        assert (output.finish_reason, len(out)) == ("length", 12)


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory, greedy_tokens):
    """tiny, written out, with a greedy output token of PROMPTS[0] declared as its EOS."""
    tokens = greedy_tokens[0]
    index = first_new_token_index(tokens)
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-eos"))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [tokens[index]]
    (folder / "config.json").write_text(json.dumps(config))
    return folder, index


def test_eos_stops_a_request_unless_ignore_eos(eos_checkpoint, greedy_tokens):
    folder, index = eos_checkpoint
    tokens = greedy_tokens[0]
    llm = LLM(str(folder), **SMALL)
    (stopped,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))
    assert (stopped.token_ids, stopped.finish_reason) == (tokens[: index + 1], "stop")
    (ignored,) = llm.generate([PROMPTS[0]], GREEDY)
    assert (ignored.token_ids, ignored.finish_reason) == (tokens, "length")


def test_generation_config_eos_ids_stop_too(eos_checkpoint, greedy_tokens):
    folder, index = eos_checkpoint
    tokens = greedy_tokens[0]
    early = first_new_token_index(tokens, 1)
    later = first_new_token_index(tokens, index + 1)
    assert early < index < later
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tokens[early]}))
    try:
        llm = LLM(str(folder), **SMALL)
    finally:
        (folder / "generation_config.json").unlink()
    assert llm.engine.eos_token_ids == {tokens[index], tokens[early]}
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(tokens[later],))
    (output,) = llm.generate([PROMPTS[0]], params)
    assert (output.token_ids, output.finish_reason) == (tokens[: early + 1], "stop")
    # With ignore_eos only the explicit stop token ends it.
    params = SamplingParams(
        max_tokens=12, temperature=0.0, stop_token_ids=(tokens[later],), ignore_eos=True
    )
    (output,) = llm.generate([PROMPTS[0]], params)
    assert (output.token_ids, output.finish_reason) == (tokens[: later + 1], "stop")


# ---- seeded sampling ----------------------------------------------------------------------


def test_the_same_seed_gives_the_same_tokens_across_engines():
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=s) for s in (1, 2)]
    first = [generate_alone(PROMPTS[0], p) for p in params]
    second = [generate_alone(PROMPTS[0], p) for p in params]
    assert first == second
    assert first[0] != first[1]


def test_without_a_seed_the_engine_seed_and_request_id_decide():
    params = SamplingParams(max_tokens=12, temperature=0.8)

    def sample(engine_seed: int, request_id: str) -> list[int]:
        engine = make_engine(seed=engine_seed)
        engine.add_request(PROMPTS[0], params, request_id=request_id)
        return run_until_idle(engine)[request_id].token_ids

    reference = sample(0, "r")
    assert sample(0, "r") == reference
    assert sample(1, "r") != reference
    assert sample(0, "other") != reference


def test_each_sample_is_seeded_by_the_request_seed_and_the_token_position(monkeypatch):
    engine = make_engine()
    rows: list[SamplingRow] = []
    positions: list[int] = []
    sample = engine.executor.driver.sampler.sample

    def recording_sample(logits, sampling_rows, row_positions, drafts=None):
        rows.extend(sampling_rows)
        positions.extend(row_positions)
        return sample(logits, sampling_rows, row_positions, drafts)

    monkeypatch.setattr(engine.executor.driver.sampler, "sample", recording_sample)
    params = SamplingParams(
        max_tokens=4, temperature=0.8, top_k=50, seed=5, min_tokens=2, stop_token_ids=(65,)
    )
    engine.add_request(PROMPTS[0], params)
    run_until_idle(engine)
    assert [r.seeds for r in rows] == [(5,)] * 4
    prompt_len = len(engine.tokenize(PROMPTS[0]))
    assert positions == [prompt_len + i for i in range(4)]
    assert [set(r.banned_token_ids) for r in rows] == [{65, 256, 258}] * 2 + [set()] * 2
    assert {(r.temperature, r.top_k, r.top_p) for r in rows} == {(0.8, 50, 1.0)}


def test_tokens_do_not_depend_on_the_batch(greedy_tokens):
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    alone_seeded = generate_alone(PROMPTS[0], seeded)
    others = [list(b"x" * n) for n in (1, 17, 40)]

    engine = make_engine(max_num_batched_tokens=16)
    other_ids = [
        engine.add_request(o, SamplingParams(max_tokens=5 + i, temperature=1.0))
        for i, o in enumerate(others)
    ]
    greedy_id = engine.add_request(PROMPTS[0], GREEDY)
    seeded_id = engine.add_request(PROMPTS[0], seeded)
    engine.add_request(PROMPTS[2], GREEDY)
    finished = run_until_idle(engine)
    assert len(finished) == 6 and set(other_ids) <= set(finished)
    assert finished[greedy_id].token_ids == greedy_tokens[0]
    assert finished[seeded_id].token_ids == alone_seeded


# ---- length caps and outputs --------------------------------------------------------------


# NOTE: a prompt of exactly max_model_len tokens is accepted and still yields one token (its
# position is never fed back), as in vLLM.
@pytest.mark.parametrize(("prompt_len", "num_out"), [(13, 3), (15, 1), (16, 1)])
def test_max_model_len_caps_prompt_plus_output(prompt_len, num_out):
    engine = make_engine(max_model_len=16)
    request_id = engine.add_request(list(b"x" * prompt_len), GREEDY)
    output = run_until_idle(engine)[request_id]
    assert (output.finish_reason, len(output.token_ids)) == ("length", num_out)
    assert_pools_at_baseline(engine)


def test_outputs_carry_the_prompt_and_the_decoded_text():
    engine = make_engine()
    request_id = engine.add_request("hello world", GREEDY)
    streamed: list[list[int]] = []
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed.append(output.token_ids)
            final = output
    assert [len(t) for t in streamed] == list(range(1, 13))
    assert final.request_id == request_id
    assert final.prompt_token_ids == list(b"hello world")
    assert final.num_cached_tokens == 0
    assert final.text == engine.tokenizer.decode(final.token_ids)
    assert streamed[-1] == final.token_ids


def test_llm_generate_takes_one_prompt_or_matching_params(greedy_tokens):
    llm = LLM("tiny", **SMALL)
    (single,) = llm.generate(PROMPTS[0], GREEDY)  # one prompt given as token ids
    assert single.token_ids == greedy_tokens[0]
    outputs = llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=3, temperature=0.0)])
    assert [len(o.token_ids) for o in outputs] == [12, 3]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(PROMPTS[:2], [GREEDY])


# ---- prompt logprobs -----------------------------------------------------------------------


def test_chunked_prompt_logprobs_equal_a_full_prompt_forward(greedy_tokens):
    prompts = [[65], list(b"hello "), list(b"a longer prompt of 23 t")]
    engine = SMALL | {"max_logprobs": -1}
    chunked = engine_logprobs(LLM("tiny", **(engine | {"max_num_batched_tokens": 5})), prompts)
    full = engine_logprobs(LLM("tiny", **(engine | {"max_num_batched_tokens": 2048})), prompts)
    for prompt, ours, reference in zip(prompts, chunked, full, strict=True):
        assert ours.shape == reference.shape == (len(prompt), VOCAB)
        assert ours.dtype == torch.float32
        # NOTE: float32 rounding, not chunking: against a float64 forward (transformers, same
        # weights) the full forward itself is off by about 1e-5, and any two budgets differ
        # by about as much. A wrong chunk boundary (state, position, KV) moves them by 1e-2.
        assert (ours - reference).abs().max() <= 2e-6 * reference.abs().max()
    # The last row predicts the first generated token.
    (logprobs,) = engine_logprobs(LLM("tiny", **engine), [PROMPTS[0]])
    assert int(logprobs[-1].argmax()) == greedy_tokens[0][0]


# ---- configuration ------------------------------------------------------------------------


def test_engine_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=4)


def test_engine_config_rejects_both_kv_pool_sizes():
    with pytest.raises(ValueError, match="num_kv_blocks or kv_cache_memory_bytes, not both"):
        EngineConfig(num_kv_blocks=8, kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize(
    ("field", "value"), [("max_num_seqs", 0), ("block_size", 0), ("dtype", "float64")]
)
def test_engine_config_rejects_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_a_kv_pool_smaller_than_one_request_is_rejected():
    with pytest.raises(ValueError) as info:
        Engine(EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=15))
    message = str(info.value)
    assert "the KV pool has 15 blocks of 4 tokens" in message
    assert "max_model_len=64 request needs 16" in message
    assert "num_kv_blocks" in message
    # tiny: 2 attention layers x K,V x 4 tokens x 2 heads x 32 dims x 4 bytes = 4096 per block.
    with pytest.raises(ValueError, match="the KV pool has 15 blocks"):
        Engine(EngineConfig(max_model_len=64, block_size=4, kv_cache_memory_bytes=15 * 4096))
    engine = Engine(EngineConfig(max_model_len=64, block_size=4, kv_cache_memory_bytes=16 * 4096))
    assert engine.num_kv_blocks == 16


def test_max_model_len_beyond_the_model_is_rejected():
    with pytest.raises(ValueError, match="max_model_len=8193 is longer than the model's"):
        Engine(EngineConfig(max_model_len=8193, num_kv_blocks=4096))


# ---- n > 1: choices fork from one prefill ---------------------------------------------------

CHOICES = SamplingParams(n=4, seed=21, temperature=1.0, max_tokens=10, ignore_eos=True)


def separate_choices(prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The oracle: n separate requests, choice i seeded seed + i."""
    return [
        generate_alone(prompt, params.model_copy(update={"n": 1, "seed": params.seed + i}))
        for i in range(params.n)
    ]


def test_n_choices_prefill_once_and_equal_separate_seeded_requests():
    engine = make_engine()
    request_id = engine.add_request(PROMPTS[1], CHOICES)
    finished = run_until_idle(engine)
    ids = [request_id, *(f"{request_id}#{i}" for i in range(1, 4))]
    assert sorted(finished) == sorted(ids)
    assert [finished[i].index for i in ids] == [0, 1, 2, 3]
    assert {finished[i].parent_request_id for i in ids[1:]} == {request_id}
    expected = separate_choices(PROMPTS[1], CHOICES)
    assert [finished[i].token_ids for i in ids] == expected
    assert len({tuple(t) for t in expected}) > 1
    # One prefill: the prompt went through the model once; the other choices forked from it.
    assert engine.scheduler.num_prompt_tokens_computed == len(PROMPTS[1])
    assert engine.scheduler.num_forks == 3
    assert_pools_at_baseline(engine)


def test_choices_that_find_no_room_at_the_fork_recompute_and_still_match():
    # Two sequences at a time and a small pool: choices wait at the fork (recomputed later)
    # and running ones are preempted; the tokens do not change.
    engine = make_engine(num_kv_blocks=14, max_model_len=32, max_num_seqs=2)
    request_id = engine.add_request(PROMPTS[1], CHOICES)
    finished = run_until_idle(engine)
    ids = [request_id, *(f"{request_id}#{i}" for i in range(1, 4))]
    assert [finished[i].token_ids for i in ids] == separate_choices(PROMPTS[1], CHOICES)
    assert engine.scheduler.num_forks < 3  # some choices could not fork in place
    # Those resumed from the prompt's snapshot in the prefix cache: the prompt ran once.
    assert engine.scheduler.num_prompt_tokens_computed == len(PROMPTS[1])
    assert_pools_at_baseline(engine)


def test_aborting_a_request_aborts_its_choices():
    engine = make_engine()
    request_id = engine.add_request(PROMPTS[0], CHOICES)
    while engine.scheduler.num_forks < 3:
        engine.step()
    output = engine.abort(request_id)
    assert output.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_pools_at_baseline(engine)
