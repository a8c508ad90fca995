"""Our engine against HF transformers on tiny random checkpoints of each architecture."""

from __future__ import annotations

import pytest
import torch

from hybridserve.workers import LLM, SamplingParams
from tests.helpers import (
    ARCHITECTURES,
    FAMILIES,
    PATH_REPRESENTATIVES,
    assert_pools_at_baseline,
    engine_logprobs,
    hf_greedy,
    hf_logprobs,
    logprob_tolerance,
    make_hf_model,
    random_prompts,
)

PROMPT_LENGTHS = [1, 2, 7, 16, 33, 100, 181, 300]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reference(request, tmp_path_factory):
    """(arch, checkpoint folder, prompts, HF greedy tokens, HF prompt log-probabilities, the
    tolerance on them)."""
    arch = request.param
    model = make_hf_model(arch)
    folder = tmp_path_factory.mktemp(arch)
    model.save_pretrained(folder)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    tokens = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    logprobs = [hf_logprobs(model, p) for p in prompts]
    return arch, folder, prompts, tokens, logprobs, logprob_tolerance(model, prompts)


def test_greedy_tokens_and_prompt_logprobs_match_transformers(reference):
    _, folder, prompts, hf_tokens, hf_prompt_logprobs, tolerance = reference
    llm = LLM(str(folder), max_logprobs=-1)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_tokens
    assert all(o.finish_reason == "length" for o in outputs)
    for ours, theirs in zip(engine_logprobs(llm, prompts), hf_prompt_logprobs, strict=True):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max() <= tolerance
    assert_pools_at_baseline(llm.engine)


# The suites below run on every family; a checkpoint form of one (FORM_ONLY) differs in what
# loads, which the test above checks.
@pytest.mark.parametrize("reference", FAMILIES, indirect=True)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("max_num_batched_tokens", [7, 16, 64])
def test_chunked_prefill_and_block_sizes_match_transformers(
    reference, max_num_batched_tokens, block_size
):
    _, folder, prompts, hf_tokens, hf_prompt_logprobs, tolerance = reference
    # Prefix caching rounds budget-cut chunks to whole blocks, so it needs budget >= block size.
    llm = LLM(
        str(folder),
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_prefix_caching=max_num_batched_tokens >= block_size,
        max_logprobs=-1,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_tokens
    # Log-probabilities of a prompt computed in budget-sized chunks equal one full forward.
    (ours,) = engine_logprobs(llm, [prompts[-1]])
    assert (ours - hf_prompt_logprobs[-1]).abs().max() <= tolerance
    assert_pools_at_baseline(llm.engine)


# The compiled graph: one family per recurrent kind (tests/helpers.py PATH_REPRESENTATIVES).
@pytest.mark.parametrize("reference", PATH_REPRESENTATIVES, indirect=True)
def test_compiled_decode_matches_transformers(reference, caplog):
    """Decode steps through torch.compile: the graph for one row and the dynamic one (eight
    rows, then rows finishing at different lengths), block tables from 1 to 21 blocks, all
    compiled at engine start: no step recompiles. (The native path is left out: it would
    take the one-row steps.)"""
    _, folder, prompts, hf_tokens, _, _ = reference
    llm = LLM(str(folder), forward_paths=("compiled", "eager"), block_size=16)
    compiled = llm.engine.executor.driver.path("compiled")
    assert compiled is not None, caplog.text
    caches = llm.engine.executor.driver.caches
    assert all(not pool.any() for pool in caches.pools().values()), "warm-up left"

    uneven = [
        SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    with torch.compiler.set_stance("fail_on_recompile"):
        together = llm.generate(prompts, GREEDY)
        alone = llm.generate([prompts[3]], GREEDY)[0]
        outputs = llm.generate(prompts, uneven)
    assert [o.token_ids for o in together] == hf_tokens
    assert alone.token_ids == hf_tokens[3]
    assert [o.token_ids for o in outputs] == [t[: 4 + 4 * i] for i, t in enumerate(hf_tokens)]
    # Every decode-only step ran compiled (31 + 31 + 31 steps at least).
    assert compiled.num_compiled_steps >= 3 * (NEW_TOKENS - 1)
    assert_pools_at_baseline(llm.engine)


@pytest.mark.parametrize("reference", FAMILIES, indirect=True)
def test_requests_together_equal_each_alone(reference):
    """16 requests of different lengths in one engine (decodes mixed with prefill chunks)
    produce what each produces on its own."""
    _, folder, _, _, _, _ = reference
    prompts = random_prompts([3 + 19 * i for i in range(16)], seed=7)
    llm = LLM(str(folder), max_num_batched_tokens=48, block_size=8)
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert together == alone
    assert_pools_at_baseline(llm.engine)
