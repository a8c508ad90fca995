"""One engine over several rank processes (`mp` executor, gloo on the CPU) against
transformers and against the same engine at TP 1 (the host tier under TP: test_host_tier.py).

Checkpoints cover the sharding rules: one KV head (replicated over the ranks), Mamba B/C groups
fewer than the ranks (replicated, the gated norm summed across ranks) and equal to them (split),
Gated DeltaNet key heads equal to the ranks (split) and fewer (replicated), three experts over two
ranks (expert parallelism, uneven), shared experts (gated ones too), q/k norms spanning every
head (OLMo), short-convolution channels (LFM2), Falcon-H1's parallel mixers, and TP 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hybridserve.workers import LLM, SamplingParams
from tests.helpers import (
    assert_pools_at_baseline,
    engine_logprobs,
    hf_greedy,
    make_hf_model,
    random_prompts,
)

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Prompts of 1..90 tokens in 24-token chunks with snapshots every 32: chunked prefill that
# resumes from the live slot, snapshot copies and prefix reuse all run on every rank.
PROMPTS = random_prompts([1, 7, 33, 90], seed=3)
# The last two prompts one token longer: their prefixes are reused the second time round.
AGAIN = [[*p, 5] for p in PROMPTS[2:]]
SMALL = {
    "block_size": 8,
    "max_num_batched_tokens": 24,
    "snapshot_interval": 32,
    "max_model_len": 256,
    "num_kv_blocks": 96,
    "max_num_seqs": 8,
}

# arch, HF overrides, TP sizes with expert parallelism off / on.
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    # MQA (one KV head), 2 Mamba groups, 3 experts + a shared expert.
    "nemotron-mqa": (
        "nemotron_h",
        {"num_key_value_heads": 1, "n_routed_experts": 3, "n_group": 1, "topk_group": 1},
    ),
    # One Mamba group < 2 ranks: B/C replicated, the gated norm group spans both ranks.
    "bamba-1-group": ("bamba", {"mamba_n_groups": 1}),
    # 2 Mamba groups = 2 ranks; 3 experts over 2 ranks; a shared expert.
    "granite-3-experts": ("granitemoehybrid", {"num_local_experts": 3}),
    # 2 GDN key heads, 4 value heads: split at TP 2, key heads replicated at TP 4; 3 experts
    # and a gated shared expert.
    "qwen3-next": ("qwen3_next", {"num_experts": 3}),
    # One GDN key head < 2 ranks: q and k replicated, value heads split.
    "qwen3.5-1-key-head": ("qwen3_5", {"linear_num_key_heads": 1}),
    "qwen3.5-moe": ("qwen3_5_moe", {}),
    # q/k norms over all heads (their sums of squares summed over the ranks) with one KV
    # head replicated on both (its sum counted twice, halved back); post-norm attention.
    "olmo-hybrid-1-kv-head": ("olmo_hybrid", {"num_key_value_heads": 1}),
    # Short-conv channels split; 3 experts over 2 ranks, chosen with an expert bias.
    "lfm2-moe-3-experts": ("lfm2_moe", {"num_experts": 3}),
    # Attention beside Mamba2; one Mamba group over 2 ranks, normed before its gate (the
    # group's sum of squares completed across the ranks); multipliers folded into shards.
    "falcon-h1-1-group": ("falcon_h1_norm", {"mamba_n_groups": 1}),
    # Mamba1 channels split, x_proj's dt | B | C all-reduced; 4 experts over 2 ranks.
    "jamba": ("jamba", {}),
    # Shared blocks over 2 ranks: their attention over [hidden | embeddings] and the
    # invocations' adapters split as the projections they add to.
    "zamba2": ("zamba2", {}),
    # Kimi Delta Attention heads split with their per-channel decays; latent attention's
    # heads split, its latent (and cache) on both ranks; experts over 2 ranks.
    "kimi-linear": ("kimi_linear", {}),
}
RUNS = [
    ("nemotron-mqa", 2, False),
    ("nemotron-mqa", 2, True),
    ("nemotron-mqa", 4, False),
    ("bamba-1-group", 2, False),
    ("granite-3-experts", 2, False),
    ("granite-3-experts", 2, True),
    ("qwen3-next", 2, False),
    ("qwen3-next", 2, True),
    ("qwen3-next", 4, False),
    ("qwen3.5-1-key-head", 2, False),
    ("qwen3.5-moe", 2, True),
    ("olmo-hybrid-1-kv-head", 2, False),
    ("lfm2-moe-3-experts", 2, False),
    ("lfm2-moe-3-experts", 2, True),
    ("falcon-h1-1-group", 2, False),
    ("jamba", 2, True),
    ("zamba2", 2, False),
    ("kimi-linear", 2, True),
]


@dataclass
class Reference:
    folder: Path
    hf_tokens: list[list[int]]
    hf_again: list[list[int]]  # AGAIN's greedy tokens: no reuse in transformers
    tp1_logprobs: list[Any]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Reference]:
    refs = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        model = make_hf_model(arch, **overrides)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        with LLM(str(folder), max_logprobs=-1, **SMALL) as tp1:
            logprobs = engine_logprobs(tp1, PROMPTS[2:])
        refs[name] = Reference(
            folder,
            [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS],
            [hf_greedy(model, p, NEW_TOKENS) for p in AGAIN],
            logprobs,
        )
    return refs


@pytest.mark.parametrize(
    ("name", "tp", "expert_parallel"), RUNS, ids=[f"{n}-tp{t}{'-ep' * e}" for n, t, e in RUNS]
)
def test_greedy_tokens_equal_transformers_and_prompt_logprobs_equal_tp1(
    references, name, tp, expert_parallel
):
    ref = references[name]
    with LLM(
        str(ref.folder),
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        max_logprobs=-1,
        **SMALL,
    ) as llm:
        assert llm.engine.config.executor_backend == "mp"
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == ref.hf_tokens
        # Same prompts again: reused snapshots and blocks, restored on every rank.
        again = llm.generate(AGAIN, GREEDY)
        assert all(o.num_cached_tokens > 0 for o in again)
        assert [o.token_ids for o in again] == ref.hf_again  # what a run without reuse gives
        for ours, tp1 in zip(engine_logprobs(llm, PROMPTS[2:]), ref.tp1_logprobs, strict=True):
            assert (ours - tp1).abs().max() <= 1e-4
        assert_pools_at_baseline(llm.engine)  # rank 0's bookkeeping and every rank's check


def test_preemption_under_tp_gives_the_tokens_of_an_ample_pool():
    prompts = random_prompts([40, 52, 61, 47], seed=9, vocab=256)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = {"block_size": 4, "max_model_len": 96, "max_num_seqs": 4}
    with LLM("tiny", num_kv_blocks=200, **common) as ample:
        expected = [o.token_ids for o in ample.generate(prompts, params)]
    with LLM("tiny", num_kv_blocks=40, tensor_parallel_size=2, **common) as tight:
        got = [o.token_ids for o in tight.generate(prompts, params)]
        assert tight.engine.scheduler.num_preemptions > 0
        assert got == expected
        assert_pools_at_baseline(tight.engine)
