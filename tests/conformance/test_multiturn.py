"""Conformance: multi-turn reuse gives exactly the tokens of a run without reuse.

The workload is a repeat-shuffle task in token space (docs/snapshot-reuse.md explains the reuse
it exercises): 6 conversations x 4 turns over 3 shared system prompts. Turn k's prompt = system
prompt + earlier turns (user message + the model's own answer) + a new user message; its "base"
is the same without the new message. Transcripts come from a run with prefix caching off; then,
for each caching configuration, the turns are replayed in a shuffled order, each base warmed
(max_tokens 1) right before its full prompt, and every full prompt's greedy tokens must equal
the reference.

Runs on tiny random checkpoints of every architecture (the Qwen3.5 image-text checkpoint is the
text model's weights in other names: its loading and outputs are checked in
tests/workers/test_parity.py), on a block-FP8 Qwen3-Next and on Qwen3.5 with an FP8 KV cache
(its transcripts too); set HYBRIDSERVE_CONFORMANCE_MODEL to an HF checkpoint folder to run it
against that model instead. One configuration per architecture of `TP_CONFIGS`
also runs at tensor_parallel_size 2 (the same transcripts: TP 1 without reuse is the oracle).
Half the configurations decode with speculation on (n-gram drafts verified and mostly rolled
back); the transcripts come without it.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hybridserve.workers import LLM, SamplingParams
from tests.fp8 import write_pair
from tests.helpers import FAMILIES, assert_pools_at_baseline, make_hf_model, random_prompts

NUM_CONVERSATIONS, NUM_TURNS, ANSWER_TOKENS = 6, 4, 12
GREEDY = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
WARM = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
COMMON = {"block_size": 16, "max_num_seqs": 8}
# Speculative decoding at its most eager: a 1-token match proposes and nothing pauses, so on
# these random models nearly every decode step verifies drafts and rolls back.
SPECULATIVE = {
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "disable_below_acceptance": 0.0,
        "disable_by_batch_size": 64,
    }
}

CONFIGS: dict[str, dict[str, Any]] = {
    "interval-only": {"snapshot_interval": 32, "save_last_snapshot": False},
    "save-last-only": {"snapshot_interval": 0, "save_last_snapshot": True},
    "interval-and-save-last": {"snapshot_interval": 48} | SPECULATIVE,
    "partial-reuse-off": {"snapshot_interval": 48, "enable_partial_reuse": False},
    "budget-below-interval": {"snapshot_interval": 64, "max_num_batched_tokens": 32} | SPECULATIVE,
    "eviction": {
        "snapshot_interval": 32,
        "num_kv_blocks": 40,
        "max_model_len": 512,
        # Live and checkpoint slots, and 6 for snapshots.
        "num_state_slots": 2 * COMMON["max_num_seqs"] + 6,
    }
    | SPECULATIVE,
}
# At tensor_parallel_size 2: one configuration per architecture, each stressing another path.
# The families added since (OLMo-Hybrid, LFM2, Falcon-H1, Jamba, Zamba2) reuse the same state
# machinery through new layers only: their TP 2 runs are against transformers
# (tests/workers/executors/test_tensor_parallel.py), as the block-FP8 checkpoint's are against
# its dequantised weights
# (tests/workers/models/test_fp8.py); this keeps the suite in CI's budget.
TP_CONFIGS = {
    "nemotron_h": "eviction",
    "bamba": "interval-and-save-last",
    "granitemoehybrid": "budget-below-interval",
    "qwen3_next": "eviction",
    "qwen3_5": "budget-below-interval",
    "qwen3_5_moe": "save-last-only",
    "qwen3_5-fp8_kv": "eviction",
    "given": "interval-and-save-last",
}
# Every architecture, one block-FP8 checkpoint (tests/fp8.py's quantizer) and one with an FP8
# KV cache.
CONFORMANCE_ARCHITECTURES = (
    *FAMILIES,
    "qwen3_next-fp8",
    "qwen3_5-fp8_kv",
)
# Engine arguments of a variant (after the architecture's "-").
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"fp8_kv": {"kv_cache_dtype": "fp8"}}


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    base: list[int]  # system prompt + earlier turns with their answers
    prompt: list[int]  # base + the new user message
    answer: list[int]  # reference greedy tokens (prefix caching off)


def build_transcripts(model: str, options: dict[str, Any]) -> list[Turn]:
    llm = LLM(model, enable_prefix_caching=False, **COMMON | options)
    vocab = llm.engine.model_config.vocab_size
    systems = random_prompts([45, 70, 90], seed=11, vocab=vocab)
    users = random_prompts(
        [5 + (i * 7) % 23 for i in range(NUM_CONVERSATIONS * NUM_TURNS)], seed=12, vocab=vocab
    )
    turns = []
    for conversation in range(NUM_CONVERSATIONS):
        history = list(systems[conversation % len(systems)])
        for index in range(NUM_TURNS):
            prompt = history + users[conversation * NUM_TURNS + index]
            (answer,) = llm.generate([prompt], GREEDY, use_tqdm=False)
            turns.append(Turn(conversation, index, history, prompt, answer.token_ids))
            history = prompt + answer.token_ids
    return turns


VARIANTS = (
    CONFORMANCE_ARCHITECTURES if not os.environ.get("HYBRIDSERVE_CONFORMANCE_MODEL") else ("given",)
)


@pytest.fixture(scope="module", params=VARIANTS)
def transcripts(request, tmp_path_factory) -> tuple[str, str, dict[str, Any], list[Turn]]:
    """(variant name, model, its engine arguments, the reference transcripts)."""
    model = os.environ.get("HYBRIDSERVE_CONFORMANCE_MODEL")
    arch, _, variant = request.param.partition("-")
    if model is None:
        folder: Path = tmp_path_factory.mktemp(arch)
        make_hf_model(arch).save_pretrained(folder)
        if variant == "fp8":
            folder, _ = write_pair(folder, tmp_path_factory.mktemp("fp8"), "block")
        model = str(folder)
    options = VARIANT_OPTIONS.get(variant, {})
    return request.param, model, options, build_transcripts(model, options)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_shuffled_multiturn_with_reuse_equals_no_reuse(transcripts, config_name):
    _, model, options, turns = transcripts
    with LLM(model, **COMMON | options | CONFIGS[config_name]) as llm:
        replay(llm, turns, config_name)


@pytest.mark.parametrize("transcripts", [v for v in VARIANTS if v in TP_CONFIGS], indirect=True)
def test_shuffled_multiturn_with_reuse_equals_no_reuse_at_tp2(transcripts):
    arch, model, options, turns = transcripts
    config_name = TP_CONFIGS[arch]
    with LLM(model, tensor_parallel_size=2, **COMMON | options | CONFIGS[config_name]) as llm:
        replay(llm, turns, config_name)


def test_first_turns_sent_together_share_their_system_prompt_and_equal_no_reuse(transcripts):
    """Every conversation's first turn at once: the first of each system prompt computes it,
    the others wait for its snapshot there (docs/snapshot-reuse.md section 6.1) rather than
    compute the same tokens beside it, and every answer is still the reference's."""
    _, model, options, turns = transcripts
    firsts = [turn for turn in turns if turn.index == 0]
    interval = CONFIGS["interval-only"]["snapshot_interval"]
    with LLM(model, **COMMON | options | CONFIGS["interval-only"]) as llm:
        outputs = llm.generate([turn.prompt for turn in firsts], GREEDY, use_tqdm=False)
        leaders: set[tuple[int, ...]] = set()
        for turn, out in zip(firsts, outputs, strict=True):
            assert out.token_ids == turn.answer, turn.conversation
            system = tuple(turn.base)
            if system in leaders:
                assert out.num_cached_tokens >= len(system) // interval * interval > 0
            leaders.add(system)
        assert_pools_at_baseline(llm.engine)


def test_a_prompt_shorter_than_a_block_reuses_its_save_last_snapshot(transcripts):
    """The cliff block-granular caches have (nothing below a block, or below the state's page
    size, is ever reused): here a 10-token prompt's snapshot at its end serves a longer prompt
    that starts with it, inside the first 16-token block."""
    _, model, options, turns = transcripts
    short = turns[0].prompt[:10]
    longer = [*short, *turns[1].prompt[:6]]
    reference = LLM(model, enable_prefix_caching=False, **COMMON | options)
    (expected,) = reference.generate([longer], GREEDY)
    with LLM(model, snapshot_interval=0, **COMMON | options) as llm:
        llm.generate([short], GREEDY, use_tqdm=False)
        (out,) = llm.generate([longer], GREEDY, use_tqdm=False)
        assert out.num_cached_tokens == len(short)
        assert out.token_ids == expected.token_ids
        assert_pools_at_baseline(llm.engine)


def replay(llm: LLM, turns: list[Turn], config_name: str) -> None:
    """Every turn in shuffled order, its base warmed right before it; each answer must be the
    reference's, with the reuse the configuration promises."""
    config = CONFIGS[config_name]
    events: list = []
    llm.engine.subscribe(type("Sink", (), {"on_cache_events": lambda self, e: events.extend(e)})())
    order = list(turns)
    random.Random(1234).shuffle(order)
    for turn in order:
        # Warm each base right before its full prompt, never all bases first: under eviction
        # pressure, warming every base up front would evict the entries under test.
        llm.generate([turn.base], WARM, use_tqdm=False)
        (out,) = llm.generate([turn.prompt], GREEDY, use_tqdm=False)
        assert out.token_ids == turn.answer, (config_name, turn.conversation, turn.index)
        assert out.num_cached_tokens <= len(turn.prompt) - 1
        if config_name == "save-last-only":
            # The base's prompt-end snapshot is the deepest usable one.
            assert out.num_cached_tokens == len(turn.base), (turn.conversation, turn.index)
        elif config_name != "eviction":
            interval = config["snapshot_interval"]
            assert out.num_cached_tokens >= len(turn.base) // interval * interval
            if not config.get("enable_partial_reuse", True):
                assert out.num_cached_tokens % COMMON["block_size"] == 0
            elif config.get("save_last_snapshot", True):
                assert out.num_cached_tokens >= len(turn.base)
        llm.engine.check_integrity()
    stats = llm.engine.cache.stats
    assert stats.hits > 0 and stats.reused_tokens > 0
    if "speculative_config" in config:
        assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0
    if config_name == "partial-reuse-off":
        assert stats.unaligned_hits == 0
    if config_name == "eviction":  # the small pools really did evict
        kinds = {type(e).__name__ for e in events}
        assert {"BlockRemoved", "SnapshotRemoved"} <= kinds
    assert_pools_at_baseline(llm.engine)
