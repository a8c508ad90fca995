"""The offline `LLM` as scripts written for `vllm.LLM` use it: stop strings in
`SamplingParams`, and `RequestOutput.outputs[i]`. Oracle: the same request without stop
strings, cut by hand."""

from __future__ import annotations

import pytest

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.core.outputs import Logprob
from tests.helpers import assert_pools_at_baseline

PROMPT = "The hybrid model reads this prompt and"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_num_seqs=4, num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def full(llm) -> str:
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))
    assert len(output.text) > 20
    return output.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_end_the_request(llm, full, include):
    stop = full[12:14]
    cut = full.index(stop)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, stop=[stop, "never appears"],
        include_stop_str_in_output=include,
    )  # fmt: skip
    (output,) = llm.generate(PROMPT, params)
    assert output.text == full[: cut + (len(stop) if include else 0)]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    assert len(output.token_ids) < 40  # generation ended there, not at max_tokens
    assert_pools_at_baseline(llm.engine)


def test_a_stop_string_ends_only_its_own_choice(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=3)
    (free,) = llm.generate(PROMPT, params)
    texts = [o.text for o in free.outputs]
    stop = texts[1][6:8]  # a string of choice 1; the others may not contain it
    (stopped,) = llm.generate(PROMPT, params.model_copy(update={"stop": (stop,)}))
    for before, after in zip(texts, stopped.outputs, strict=True):
        if stop in before:
            assert after.text == before[: before.index(stop)] and after.stop_reason == stop
        else:
            assert after.text == before and after.finish_reason == "length"
    assert_pools_at_baseline(llm.engine)


def test_outputs_are_vllm_completion_outputs(llm):
    (output,) = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))
    (choice,) = output.outputs
    assert (choice.index, choice.text, choice.token_ids) == (0, output.text, output.token_ids)
    assert choice.finish_reason == "length" and choice.stop_reason is None
    assert len(choice.logprobs) == 6
    for token_id, entry, raw in zip(
        choice.token_ids, choice.logprobs, output.logprobs, strict=True
    ):
        assert isinstance(entry[token_id], Logprob) and entry[token_id].logprob == raw.logprob
        assert entry[token_id].rank == 1  # greedy: the top token
        assert len(entry) <= 3
    assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in output.logprobs))


def test_the_engine_refuses_stop_strings_it_cannot_match(llm):
    with pytest.raises(ValueError, match="stop strings are matched where text is made"):
        llm.engine.add_request(PROMPT, SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=[""])
