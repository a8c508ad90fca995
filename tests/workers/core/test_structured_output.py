"""Structured output on the engine (llguidance): the output satisfies its JSON schema, regex,
choice list or Lark grammar, also across preemption and for each of n choices; a grammar's
state forks with a choice; a bad spec is refused before anything is allocated."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hybridserve.workers import Engine, EngineConfig, SamplingParams
from hybridserve.workers.core.sampling_params import StructuredOutput
from hybridserve.workers.core.structured_output import GrammarCompiler
from hybridserve.workers.models.tiny import tiny_tokenizer
from tests.helpers import PERSON_SCHEMA, assert_pools_at_baseline

SCHEMA = StructuredOutput(kind="json_schema", spec=json.dumps(PERSON_SCHEMA))
PROMPTS = [list(b"person:"), list(b"who?"), list(b"JSON please"), list(b"{")]
ENGINE = {"max_model_len": 96, "block_size": 4, "max_num_seqs": 4}


def constrained(spec: StructuredOutput, seed: int, **params) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=64, structured_output=spec, **params
    )


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    requests = list(engine.scheduler.waiting)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        engine.check_integrity()
    assert_pools_at_baseline(engine)
    preemptions = sum(r.num_preemptions for r in requests)
    return {"outputs": [finished[i] for i in ids], "preemptions": preemptions}


def test_json_schema_output_validates_and_is_unchanged_by_preemption():
    params = [constrained(SCHEMA, seed) for seed in range(len(PROMPTS))]
    ample = run_all(Engine(EngineConfig(num_kv_blocks=128, **ENGINE)), PROMPTS, params)
    tight = run_all(Engine(EngineConfig(num_kv_blocks=26, **ENGINE)), PROMPTS, params)
    assert ample["preemptions"] == 0 and tight["preemptions"] > 0
    for a, t in zip(ample["outputs"], tight["outputs"], strict=True):
        assert a.token_ids == t.token_ids
        assert a.finish_reason == "stop", a.text
        jsonschema.validate(json.loads(a.text), PERSON_SCHEMA)
    assert len({o.text for o in ample["outputs"]}) > 1  # sampled, not one fixed answer


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutput(kind="json"), lambda text: isinstance(json.loads(text), dict)),
        (
            StructuredOutput(kind="regex", spec=r"[a-c]{3}-[0-9]{2}"),
            lambda text: re.fullmatch(r"[a-c]{3}-[0-9]{2}", text) is not None,
        ),
        (
            StructuredOutput(kind="choice", spec=json.dumps(["yes", "no", "maybe"])),
            lambda text: text in {"yes", "no", "maybe"},
        ),
        (
            StructuredOutput(kind="grammar", spec='start: "x" DIGIT DIGIT\nDIGIT: /[0-9]/'),
            lambda text: re.fullmatch(r"x[0-9]{2}", text) is not None,
        ),
    ],
    ids=["json", "regex", "choice", "lark"],
)
def test_each_kind_of_constraint_holds(spec, check):
    engine = Engine(EngineConfig(num_kv_blocks=128, **ENGINE))
    params = [constrained(spec, seed) for seed in range(2)]
    for output in run_all(engine, PROMPTS[:2], params)["outputs"]:
        assert output.finish_reason == "stop"
        assert check(output.text), output.text


def test_every_choice_of_n_satisfies_the_schema():
    engine = Engine(EngineConfig(num_kv_blocks=128, **ENGINE))
    engine.add_request(PROMPTS[0], constrained(SCHEMA, 3, n=3), request_id="r")
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(finished) == ["r", "r#1", "r#2"]
    for output in finished.values():
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)
    assert engine.scheduler.num_forks == 2
    assert_pools_at_baseline(engine)


def test_a_forked_grammar_advances_on_its_own():
    tokenizer = tiny_tokenizer()
    compiler = GrammarCompiler(tokenizer, 259, [256])
    grammar = compiler.compile(StructuredOutput(kind="choice", spec=json.dumps(["ab", "cd"])))
    allowed = grammar.bitmask()
    assert _allowed(allowed) == {ord("a"), ord("c")}
    fork = grammar.fork()
    grammar.accept(ord("a"))
    fork.accept(ord("c"))
    assert _allowed(grammar.bitmask()) == {ord("b")}
    assert _allowed(fork.bitmask()) == {ord("d")}
    grammar.accept(ord("b"))
    assert _allowed(grammar.bitmask()) == {256}  # done: only the end of sequence is left


def _allowed(bitmask: bytes) -> set[int]:
    words = [int.from_bytes(bitmask[i : i + 4], "little") for i in range(0, len(bitmask), 4)]
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1}


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        (StructuredOutput(kind="json_schema", spec='{"type": "nonsense"}'), "json_schema"),
        (StructuredOutput(kind="json_schema", spec="{not json"), "json_schema"),
        (StructuredOutput(kind="regex", spec="("), "regex"),
        (StructuredOutput(kind="grammar", spec="start: undefined_rule"), "grammar"),
    ],
)
def test_a_bad_spec_is_refused_before_anything_is_allocated(spec, shown):
    engine = Engine(EngineConfig(num_kv_blocks=128, **ENGINE))
    with pytest.raises(ValueError, match=f"invalid {shown} for structured output"):
        engine.add_request(PROMPTS[0], constrained(spec, 0))
    assert not engine.has_unfinished_requests()
    assert_pools_at_baseline(engine)
