"""Speculative decoding on the engine: the oracle is the same engine without speculation.

Greedy tokens must be identical for every family, batched and alone, whatever the drafts: with
n-gram lookup at its most eager (a 1-token match proposes, nothing pauses: on random models
nearly every draft is rejected, so every step rolls back) and with an oracle proposer that
proposes the reference continuation with one token wrong at position j of each span, for
every j (j = k: every draft stands). Sampling controls, logprobs, structured output, n > 1,
preemption and turn-end snapshots keep working with it on; bad configurations are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hybridserve.workers import LLM, Engine, EngineConfig, SamplingParams
from hybridserve.workers.core.request import Request
from hybridserve.workers.core.sampling_params import StructuredOutput
from hybridserve.workers.speculative.proposer import Proposer
from tests.helpers import (
    FAMILIES,
    PERSON_SCHEMA,
    assert_pools_at_baseline,
    make_hf_model,
    random_prompts,
)

K = 4
EAGER_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "disable_below_acceptance": 0.0,
    "disable_by_batch_size": 64,
}
ENGINE = {"max_model_len": 160, "block_size": 8, "max_num_seqs": 4, "enable_prefix_caching": False}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class OracleProposer(Proposer):
    """Proposes each request's reference continuation (nothing for a prompt it has none of),
    with the token at offset `wrong_at` of every span changed (offset K or more: every draft
    is right)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], wrong_at: int) -> None:
        self.references, self.wrong_at = references, wrong_at
        self.spans: dict[str, list[int]] = {}  # request id -> the length of each proposal

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        proposals = []
        for request, num_tokens in batch:
            reference = self.references.get(tuple(request.prompt_token_ids), [])
            start = request.num_output_tokens
            drafts = reference[start : start + num_tokens]
            if self.wrong_at < len(drafts):
                drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 100
            self.spans.setdefault(request.request_id, []).append(len(drafts))
            proposals.append(drafts)
        return proposals


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory) -> str:
    """A random checkpoint of the test vocabulary that no family's target agrees with."""
    folder = tmp_path_factory.mktemp("draft")
    make_hf_model(
        "nemotron_h", seed=9, num_hidden_layers=2, hybrid_override_pattern="M*"
    ).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, reference greedy tokens without speculation)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(folder)
    prompts = random_prompts([23, 41, 9], seed=3)
    with LLM(str(folder), **ENGINE) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return str(folder), prompts, reference


def generate(model: str, prompts: list[list[int]], params, **options) -> list:
    with LLM(model, **ENGINE | options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_pools_at_baseline(llm.engine)
    return outputs


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_greedy_tokens_equal_without_speculation_with_ngram_drafts(family, batched):
    model, prompts, reference = family
    groups = [prompts] if batched else [[p] for p in prompts]
    outputs = [
        output
        for group in groups
        for output in generate(model, group, GREEDY, speculative_config=EAGER_NGRAM)
    ]
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.speculation.num_draft_tokens for o in outputs) > 0  # drafts were verified


@pytest.mark.parametrize("draft", ["self", "unrelated"])
def test_greedy_tokens_equal_without_speculation_with_a_draft_model(family, draft, unrelated_draft):
    """The target as its own draft: nearly every draft stands. An unrelated random draft:
    nearly none does, so every step rolls back the draft's state and the target's."""
    model, prompts, reference = family
    spec = {
        "method": "draft_model",
        "model": model if draft == "self" else unrelated_draft,
        "num_speculative_tokens": K,
        "disable_below_acceptance": 0.0,
        "disable_by_batch_size": 64,
    }
    with LLM(model, speculative_config=spec, **ENGINE) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == reference
        stats = llm.engine.scheduler.speculator.stats
        rate = stats.num_accepted_tokens / stats.num_draft_tokens
        assert rate > 0.9 if draft == "self" else rate < 0.2, rate
        assert_pools_at_baseline(llm.engine)
        draft_cache = llm.engine.scheduler.speculator.proposer.cache
        draft_cache.check_integrity()
        assert draft_cache.num_free_slots == ENGINE["max_num_seqs"]


def test_the_draft_model_s_state_rolls_back_with_rejected_drafts(tmp_path):
    """The target penalises repetition, its own draft does not: the draft's guesses fail
    now and then, its state goes back to its checkpoint, and it guesses right again from
    there (a draft whose state kept a rejected token stays wrong: about 0.12 here, against
    0.37)."""
    make_hf_model("nemotron_h").save_pretrained(tmp_path)
    prompts = random_prompts([23, 41, 9], seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    with LLM(str(tmp_path), **ENGINE) as plain:
        reference = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": K}
    spec |= {"disable_below_acceptance": 0.0, "disable_by_batch_size": 64}
    with LLM(str(tmp_path), speculative_config=spec, **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, False)] == reference
        stats = llm.engine.scheduler.speculator.stats
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.3


# Every offset on the native path (its rows advance the state one after the other); the
# eager path (the chunked kernels) at the ends of the span.
FORCED = [("native", j) for j in range(K + 1)] + [("eager", 0), ("eager", K)]


@pytest.mark.parametrize(("path", "wrong_at"), FORCED, ids=[f"{p}-{j}" for p, j in FORCED])
def test_forced_rejection_at_each_position_of_a_span(family, path, wrong_at):
    model, prompts, reference = family
    paths = ("native", "eager") if path == "native" else ("eager",)
    with LLM(model, speculative_config=EAGER_NGRAM, forward_paths=paths, **ENGINE) as llm:
        references = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
        proposer = OracleProposer(references, wrong_at)
        llm.engine.scheduler.speculator.proposer = proposer
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == reference
        for output in outputs:
            # Every verify step accepted exactly the drafts before the wrong one.
            spans = [n for n in proposer.spans[output.request_id] if n]
            expected = [sum(n > j for n in spans) if j < wrong_at else 0 for j in range(K)]
            stats = output.speculation
            assert stats.num_drafts == len(spans) > 0
            assert stats.accepted_per_position + [0] * (K - len(stats.accepted_per_position)) == (
                expected
            )
        assert_pools_at_baseline(llm.engine)


# ---- everything else keeps working ----------------------------------------------------------

TINY = {"max_model_len": 96, "block_size": 4, "max_num_seqs": 4, "enable_prefix_caching": False}
TINY_PROMPTS = [list(b"abcabcabcab"), list(b"the cat and the cat and the"), list(b"xyzxyz")]


def tiny_tokens(params: SamplingParams, speculate: bool, **options) -> list:
    spec = {"speculative_config": EAGER_NGRAM} if speculate else {}
    with LLM("tiny", **TINY | spec | options) as llm:
        outputs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
        assert_pools_at_baseline(llm.engine)
        if speculate:
            assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0
        return outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias=((97, 3.0),),
        ),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=8, stop_token_ids=(98, 99)),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
    ],
    ids=["repetition", "presence-frequency-bias", "min-tokens-stops", "n2", "sampled-seeded"],
)
def test_sampling_controls_give_the_same_tokens_with_speculation(params):
    """Greedy rows are exact; the sampled row is checked for what rejection sampling keeps:
    its tokens do not depend on the batch (a request alone draws what it draws batched)."""
    batched = tiny_tokens(params, speculate=True)
    if params.temperature == 0.0:
        plain = tiny_tokens(params, speculate=False)
        assert [o.token_ids for o in batched] == [o.token_ids for o in plain]
        assert [o.finish_reason for o in batched] == [o.finish_reason for o in plain]
        if params.n > 1:
            assert [[c.token_ids for c in o.choices] for o in batched] == [
                [c.token_ids for c in o.choices] for o in plain
            ]
        return
    with LLM("tiny", speculative_config=EAGER_NGRAM, **TINY) as llm:
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in TINY_PROMPTS]
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]


def test_logprobs_are_the_same_with_speculation():
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    for spec, plain in zip(
        tiny_tokens(params, speculate=True), tiny_tokens(params, speculate=False), strict=True
    ):
        assert spec.token_ids == plain.token_ids
        for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_structured_output_drafts_are_masked_and_the_grammar_rolls_back():
    spec = StructuredOutput(kind="json_schema", spec=json.dumps(PERSON_SCHEMA))
    params = SamplingParams(max_tokens=64, temperature=0.0, structured_output=spec)
    outputs = tiny_tokens(params, speculate=True)
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in tiny_tokens(params, speculate=False)
    ]
    for output in outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)


def test_preempted_speculating_requests_recompute_the_same_tokens():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(num_kv_blocks=24, speculative_config=EAGER_NGRAM, **TINY))
    ids = [engine.add_request(p, params) for p in TINY_PROMPTS]
    requests = list(engine.scheduler.waiting)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        engine.check_integrity()
    assert sum(r.num_preemptions for r in requests) > 0
    plain = tiny_tokens(params, speculate=False)
    assert [finished[i].token_ids for i in ids] == [o.token_ids for o in plain]


def test_the_next_turn_resumes_from_the_exact_turn_end_snapshot():
    """A turn that ends inside a verified span (max_tokens cuts it) commits the state after
    exactly its tokens: the next turn reuses it and equals a run without reuse."""
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    options = TINY | {"enable_prefix_caching": True, "snapshot_turn_end": True}
    with LLM("tiny", speculative_config=EAGER_NGRAM, **options) as llm:
        first = llm.generate([TINY_PROMPTS[1]], params, use_tqdm=False)[0]
        follow = TINY_PROMPTS[1] + first.token_ids + list(b" and")
        (second,) = llm.generate([follow], params, use_tqdm=False)
        assert second.num_cached_tokens >= len(TINY_PROMPTS[1]) + len(first.token_ids) - 1
        assert_pools_at_baseline(llm.engine)
    with LLM("tiny", **TINY) as plain:
        assert second.token_ids == plain.generate([follow], params, use_tqdm=False)[0].token_ids


def test_a_stop_token_inside_a_verified_span_commits_the_state_before_the_rest():
    """Every draft is right, and one of them is a stop token: the tokens after it are dropped,
    so the state after the whole span is not the request's: the checkpoint goes back, the
    turn-end snapshot is taken from it, and the next turn, reusing it, equals a plain run."""
    prompt = TINY_PROMPTS[1]
    with LLM("tiny", **TINY) as plain:
        free = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0), False)
    reference = free[0].token_ids
    # Output 0 comes from the prompt; spans of K drafts + 1 follow: a stop at an index that
    # does not end a span lands on a draft with drafts after it.
    stop_at = next(
        i for i in range(2, len(reference)) if reference[i] not in reference[:i] and i % (K + 1)
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(reference[stop_at],))
    options = TINY | {"enable_prefix_caching": True, "snapshot_turn_end": True}
    with LLM("tiny", speculative_config=EAGER_NGRAM, **options) as llm:
        proposer = OracleProposer({tuple(prompt): reference}, wrong_at=K)
        llm.engine.scheduler.speculator.proposer = proposer
        (first,) = llm.generate([prompt], params, use_tqdm=False)
        assert first.token_ids == reference[: stop_at + 1]
        assert first.speculation.num_accepted_tokens > 0
        follow = prompt + first.token_ids + list(b" and")
        (second,) = llm.generate([follow], GREEDY, use_tqdm=False)
        # The span's start: the state there came back from the checkpoint.
        assert second.num_cached_tokens >= len(prompt)
        assert_pools_at_baseline(llm.engine)
    with LLM("tiny", **TINY) as plain:
        assert second.token_ids == plain.generate([follow], GREEDY, use_tqdm=False)[0].token_ids


def test_requests_whose_drafts_fail_pause_and_large_batches_do_not_speculate():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in tiny_tokens(params, speculate=False)]
    pausing = EAGER_NGRAM | {"disable_below_acceptance": 0.9}
    with LLM("tiny", speculative_config=pausing, **TINY) as llm:
        assert [o.token_ids for o in llm.generate(TINY_PROMPTS, params, False)] == plain
        assert llm.engine.scheduler.speculator.num_paused > 0
    # The CPU default: only as many requests as verify within eight rows speculate.
    with LLM("tiny", speculative_config={"num_speculative_tokens": 3}, **TINY) as llm:
        assert llm.engine.scheduler.speculator.max_batch_size == 2
        llm.generate(TINY_PROMPTS, params, use_tqdm=False)  # three at once: no drafts
        assert llm.engine.scheduler.speculator.stats.num_drafts == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "ngram", "model": "tiny"}, "model is the draft_model method's checkpoint"),
        ({"method": "draft_model"}, "method 'draft_model' needs model"),
        ({"num_speculative_tokens": 17}, "less than or equal to 16"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "eagle"}, "Input should be 'ngram', 'draft_model' or 'mtp'"),
    ],
)
def test_bad_speculative_configs_are_refused_at_start(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=options)


def test_a_draft_model_of_another_vocabulary_is_refused_at_start(unrelated_draft):
    spec = {"method": "draft_model", "model": unrelated_draft}
    with pytest.raises(ValueError, match="vocabulary of 128 tokens, the target 259"):
        LLM("tiny", speculative_config=spec, **TINY)


def test_state_slots_must_hold_a_checkpoint_per_running_request():
    with pytest.raises(ValueError, match="checkpoint slot too"):
        EngineConfig(max_num_seqs=4, num_state_slots=6, speculative_config={})
