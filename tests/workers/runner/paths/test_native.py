"""Small decode steps as one C call (workers/runner/paths/native.py) against transformers, on
each layer shape it serves; models and settings it does not serve keep their other paths."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.kernels.cpu import decode_step as cpu_decode_step
from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.runner import model_runner
from hybridserve.workers.runner.paths import native as native_module
from tests.fp8 import write_pair
from tests.helpers import (
    assert_pools_at_baseline,
    hf_greedy,
    hf_logprobs,
    logprob_tolerance,
    make_hf_model,
    random_prompts,
)

NEW_TOKENS = 16
# One request at a time: every decode step is one row, so every one runs the native step.
PROMPT_LENGTHS = [1, 7, 40]
DENSE_NEMOTRON = ["linear_attention", "full_attention", "mlp"] * 2  # Mamba2, attention, MLP

# name -> (architecture, config overrides): every layer kind, activation and option the
# kernel reads.
SHAPES = {
    # Mamba2, attention without RoPE, ungated relu2 MLP
    "nemotron_h": ("nemotron_h", {"layers_block_type": DENSE_NEMOTRON}),
    # ... with every bias on (in/out projections, conv, attention, MLP)
    "nemotron_h_biases": (
        "nemotron_h",
        {
            "layers_block_type": DENSE_NEMOTRON,
            "attention_bias": True,
            "mlp_bias": True,
            "mamba_proj_bias": True,
            "use_conv_bias": True,
        },
    ),
    # head size 64 (the attention's unrolled path), one KV head, gelu, no conv bias
    "nemotron_h_head_64": (
        "nemotron_h",
        {
            "layers_block_type": DENSE_NEMOTRON,
            "head_dim": 64,
            "num_key_value_heads": 1,
            "mlp_hidden_act": "gelu",
            "use_conv_bias": False,
        },
    ),
    # head size 128 (the other unrolled path)
    "nemotron_h_head_128": ("nemotron_h", {"layers_block_type": DENSE_NEMOTRON, "head_dim": 128}),
    # projections whose rows are not a multiple of four (the mat-vec's piece): in_proj
    # 2 * 48 + 2 * 2 * 16 + 6 = 166 rows, the MLP's up 94, and q, k, v of 30, 10 and 10 rows,
    # whose pieces straddle one projection's end and the next one's start
    "nemotron_h_odd_rows": (
        "nemotron_h",
        {
            "layers_block_type": DENSE_NEMOTRON,
            "mamba_num_heads": 6,
            "intermediate_size": 94,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 10,
        },
    ),
    # a gated MLP of 94 rows a half (its last piece is two rows)
    "bamba_odd_rows": ("bamba", {"intermediate_size": 94}),
    # no Mamba pools
    "attention_only": ("nemotron_h", {"layers_block_type": ["full_attention", "mlp"] * 2}),
    # RoPE attention, gated silu MLP
    "bamba": ("bamba", {}),
    # embedding and residual multipliers, attention multiplier, logits scaling, RoPE, the
    # shared MLP alone
    "granite_dense": (
        "granitemoehybrid",
        {"num_local_experts": 0, "position_embedding_type": "rope"},
    ),
    # Gated DeltaNet (head dims 12 and 10, two value heads a key head), gated attention with
    # zero-centred q/k norms and partial RoPE, zero-centred residual norms
    "qwen3_5": ("qwen3_5", {}),
    # OLMo: post-norm attention and MLP sublayers, q/k norms over all heads, beta doubled,
    # attention without RoPE
    "olmo_hybrid": ("olmo_hybrid", {}),
    # LFM2: gated short convolutions (conv, in_proj and out_proj biases), per-head q/k norms
    "lfm2": ("lfm2", {"conv_bias": True}),
    # Falcon-H1: attention beside Mamba2 (parallel sublayers), the Mamba2 gate without a norm
    # and with it before the gate, biases on every projection, folded muP multipliers
    "falcon_h1": ("falcon_h1", {}),
    "falcon_h1_norm": ("falcon_h1_norm", {}),
    # one key head for four value heads, one KV head, an MLP of 94 rows
    "qwen3_5_one_key_head": (
        "qwen3_5",
        {"linear_num_key_heads": 1, "num_key_value_heads": 1, "intermediate_size": 94},
    ),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    """(checkpoint folder, prompts, HF greedy tokens, HF log-probabilities of prompt + tokens,
    their tolerance: tests/helpers.logprob_tolerance)."""
    arch, overrides = SHAPES[request.param]
    model = make_hf_model(arch, **overrides)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    tokens = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    sequences = [p + t for p, t in zip(prompts, tokens, strict=True)]
    logprobs = [hf_logprobs(model, sequence) for sequence in sequences]
    return folder, prompts, tokens, logprobs, logprob_tolerance(model, sequences)


@pytest.mark.parametrize("block_size", [4, 16])
def test_one_request_at_a_time_matches_transformers(reference, block_size):
    """Greedy tokens equal transformers', and each generated token's log-probability (from the
    native step's hidden state) is transformers' within 1e-4 (or transformers' own float32
    error); blocks of 4 tokens make the attention walk up to 14 blocks and write K and V at
    every offset."""
    folder, prompts, hf_tokens, hf_table, tolerance = reference
    llm = LLM(str(folder), block_size=block_size, max_logprobs=-1)
    native = llm.engine.executor.driver.path("native")
    assert native is not None
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    for prompt, expected, table in zip(prompts, hf_tokens, hf_table, strict=True):
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert output.token_ids == expected
        for index, entry in enumerate(output.logprobs):
            theirs = table[len(prompt) - 1 + index, entry.token_id].item()
            assert abs(entry.logprob - theirs) <= tolerance
    assert native.num_steps == len(prompts) * (NEW_TOKENS - 1)
    assert_pools_at_baseline(llm.engine)


def test_steps_of_more_rows_keep_the_batched_path(reference):
    """MAX_ROWS + 1 requests decoding together run the model's batched step; once one is done,
    the other MAX_ROWS run natively together, then the last one alone, and every request's
    tokens are its prompt's alone."""
    folder, prompts, hf_tokens, _, _ = reference
    llm = LLM(str(folder))
    max_rows = native_module.MAX_ROWS
    count = max_rows + 1
    chosen = [i % len(prompts) for i in range(count)]
    lengths = [NEW_TOKENS // 4] + [NEW_TOKENS // 2] * (count - 2) + [NEW_TOKENS]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate([prompts[i] for i in chosen], params, use_tqdm=False)
    expected = [hf_tokens[i][:n] for i, n in zip(chosen, lengths, strict=True)]
    assert [o.token_ids for o in outputs] == expected
    native = llm.engine.executor.driver.path("native")
    # The first tokens come with the prompts; tokens 2-4 of all batched, 5-8 of MAX_ROWS and
    # 9-16 of one natively.
    assert (native.num_steps, native.num_rows) == (4 + 8, max_rows * 4 + 8)
    assert_pools_at_baseline(llm.engine)


# Shapes transformers does not run as we do: it clamps dt differently in its prompt and
# decode paths, and cannot generate with a model without attention layers. The oracle is the
# model's eager step.
EAGER_ORACLE_SHAPES = {
    # dt clamped on both sides (inside the spread of dt)
    "clamped_dt": {"layers_block_type": DENSE_NEMOTRON, "time_step_limit": (0.02, 0.1)},
    # no KV pool
    "mamba_only": {"layers_block_type": ["linear_attention", "mlp"] * 2},
}


@pytest.mark.parametrize("shape", list(EAGER_ORACLE_SHAPES))
def test_shapes_transformers_cannot_check_match_the_eager_step(tmp_path, shape):
    folder = tmp_path / shape
    make_hf_model("nemotron_h", **EAGER_ORACLE_SHAPES[shape]).save_pretrained(folder)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    runs = []
    for native in (True, False):
        llm = LLM(str(folder), forward_paths=("native", "eager") if native else ("eager",))
        assert (llm.engine.executor.driver.path("native") is not None) == native
        runs.append([llm.generate([p], params, use_tqdm=False)[0] for p in prompts])
    for ours, eager in zip(*runs, strict=True):
        assert ours.token_ids == eager.token_ids
        for mine, reference in zip(ours.logprobs, eager.logprobs, strict=True):
            assert abs(mine.logprob - reference.logprob) <= 1e-5


def test_models_with_moe_layers_keep_their_other_paths(tmp_path, caplog):
    folder = tmp_path / "moe"
    make_hf_model("nemotron_h").save_pretrained(folder)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        llm = LLM(str(folder))
    assert llm.engine.executor.driver.path("native") is None
    assert "forward path native: off (moe layers)" in caplog.text


def test_it_can_be_turned_off_and_the_reference_backend_turns_it_off(monkeypatch):
    assert LLM("tiny", forward_paths=("eager",)).engine.executor.driver.path("native") is None
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_BACKEND", "reference")
    assert cpu_decode_step.kernel() is None
    assert LLM("tiny").engine.executor.driver.path("native") is None


def test_it_writes_the_states_and_scores_the_models_step_does():
    """Each native step of MAX_ROWS requests, then of one fewer after each step, runs twice from
    the same pools, eagerly and natively: the Mamba states and KV blocks after it, every row's
    token and its log-probability agree."""
    llm = LLM("tiny")
    runner = llm.engine.executor.driver
    native = runner.path("native")
    execute = runner.execute
    compared = []

    def both_ways(plan):
        decode_only = bool(plan.chunks) and all(c.is_decode for c in plan.chunks)
        if not (decode_only and len(plan.chunks) <= native_module.MAX_ROWS):
            return execute(plan)
        before = [pool.clone() for pool in _pools(runner)]
        paths = runner.paths
        runner.paths = [path for path in paths if path is not native]
        eager = execute(plan)
        eager_pools = [pool.clone() for pool in _pools(runner)]
        for pool, saved in zip(_pools(runner), before, strict=True):
            pool.copy_(saved)
        runner.paths = paths
        ours = execute(plan)
        for pool, theirs in zip(_pools(runner), eager_pools, strict=True):
            torch.testing.assert_close(pool, theirs, rtol=1e-5, atol=1e-5)
        for mine, reference in zip(ours.samples, eager.samples, strict=True):
            assert mine.token_ids == reference.token_ids
            assert abs(mine.logprobs[0].logprob - reference.logprobs[0].logprob) <= 1e-5
        compared.append(len(plan.chunks))
        return ours

    runner.execute = both_ways
    max_rows = native_module.MAX_ROWS
    lengths = range(2, max_rows + 2)  # one request ends after each step
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in lengths
    ]
    prompt_lengths = [21, 40, 5, 33, 12, 27, 8, 16][:max_rows]
    llm.generate(random_prompts(prompt_lengths, seed=2), params, use_tqdm=False)
    # The first tokens come with the prompts; then token 2 of all, token 3 of all but one, ...
    assert compared == list(range(max_rows, 0, -1))
    assert (native.num_steps, native.num_rows) == (max_rows, sum(compared))
    assert_pools_at_baseline(llm.engine)


@pytest.mark.parametrize("lm_head", ["trained", "zeros", "nan_row"])
def test_each_rows_greedy_token_is_torchs_argmax_of_its_logits(lm_head):
    """The kernel's argmax, kept per thread and compared across threads, picks what
    torch.argmax picks: with every logit zero the first (a tie across threads' pieces), and
    a NaN over any number. Three requests at a time: each step has several rows."""
    llm = LLM("tiny")
    runner = llm.engine.executor.driver
    native = runner.path("native")
    step = native.step
    weight = runner.model.lm_head_weight
    nan_token = weight.shape[0] - 7  # in the last pieces of four, past the first thread's
    with torch.no_grad():
        if lm_head == "zeros":
            weight.zero_()
        elif lm_head == "nan_row":
            weight[nan_token] = float("nan")
    steps = []

    def recorded(chunks):
        steps.append(step(chunks))
        return steps[-1]

    native.step = recorded
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts([9, 14, 3], seed=5), params, use_tqdm=False)
    assert {len(step.greedy_token_ids) for step in steps} == {3}
    for step in steps:
        assert step.greedy_token_ids == step.logits.argmax(dim=-1).tolist()
    expected = {"zeros": 0, "nan_row": nan_token}.get(lm_head)
    if expected is not None:
        assert {t for step in steps for t in step.greedy_token_ids} == {expected}
    assert_pools_at_baseline(llm.engine)


def _pools(runner):
    caches = runner.caches
    return list(caches.pools().values())


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("shape", ["nemotron_h", "qwen3_5"])
def test_fp8_weights_are_read_as_bytes_and_match_the_eager_step(tmp_path, shape, kind):
    """An FP8 checkpoint held FP8: the native step's mat-vecs read the bytes and scales (a
    short last group of columns in the block layout) at one row, and decode them once for
    several; the oracle is the eager step, whose GEMMs the FP8 kernel tests check."""
    source = tmp_path / shape
    make_hf_model(*SHAPES[shape][:1], **SHAPES[shape][1]).save_pretrained(source)
    fp8, _ = write_pair(source, tmp_path, kind)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = random_prompts(PROMPT_LENGTHS, seed=8)
    runs = []
    for paths in (("native", "eager"), ("eager",)):
        llm = LLM(str(fp8), fp8_weights="keep", forward_paths=paths)
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        runs.append(alone + llm.generate(prompts, params, use_tqdm=False))
        native = llm.engine.executor.driver.path("native")
        assert (native is not None and native.num_steps > 0) == ("native" in paths)
    # Float32 sums in another order (per group of columns, then scaled): the suite's floor
    # for float32 against float32 (helpers.logprob_tolerance); a wrong scale or byte is far off.
    for ours, eager in zip(*runs, strict=True):
        assert ours.token_ids == eager.token_ids
        for mine, reference in zip(ours.logprobs, eager.logprobs, strict=True):
            assert abs(mine.logprob - reference.logprob) <= 1e-4
