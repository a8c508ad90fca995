"""Tensor/expert parallel sharding rules, and shapes refused before any process starts."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from hybridserve.workers import EngineConfig
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.models.tiny import TINY_CONFIG

NEMOTRON_MOE = {
    "hybrid_override_pattern": "M*E",
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
}
# A Qwen3.5 (Gated DeltaNet) config: 2 key heads, 4 value heads.
QWEN35 = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
}


def context(tp: int, rank: int, expert_parallel: bool = False) -> ParallelContext:
    return ParallelContext(tp, rank, expert_parallel, collectives=object())  # type: ignore[arg-type]


def test_a_dimension_with_as_many_units_as_ranks_or_more_is_split():
    assert [context(2, r).piece(64, 4) for r in (0, 1)] == [(0, 32), (32, 32)]
    assert [context(4, r).piece(64, 4) for r in range(4)] == [(0, 16), (16, 16), (32, 16), (48, 16)]


def test_fewer_units_than_ranks_are_replicated_each_to_the_ranks_that_read_it():
    # 2 KV heads (16 rows each) over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [context(4, r).piece(32, 2) for r in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    # One head (MQA): every rank holds it.
    assert {context(4, r).piece(16, 1) for r in range(4)} == {(0, 16)}


def test_experts_are_partitioned_unevenly_when_the_count_does_not_divide():
    assert [context(2, r).expert_range(3) for r in (0, 1)] == [(0, 2), (2, 1)]
    assert [context(4, r).expert_range(10) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]


def test_the_vocabulary_is_padded_to_a_multiple_of_the_ranks():
    assert [context(2, r).vocab_range(259) for r in (0, 1)] == [(0, 130, 130), (130, 129, 130)]
    assert context(1, 0).vocab_range(259) == (0, 259, 259)


def write_config(folder: Path, **changes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG | changes))
    return str(folder)  # no weights: validation reads config.json only


@pytest.mark.parametrize(
    ("changes", "tp", "expert_parallel", "message"),
    [
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, 2, False,
         r"num_attention_heads \(5\) over 2 ranks: not divisible"),
        ({"num_key_value_heads": 6, "num_attention_heads": 12}, 4, False,
         r"num_key_value_heads \(6\) over 4 ranks: not divisible"),
        ({"num_key_value_heads": 3, "num_attention_heads": 12}, 4, False,
         r"num_key_value_heads \(3\) over 4 ranks: fewer than the ranks and not a divisor"),
        ({"mamba_num_heads": 6, "n_groups": 2}, 4, False,
         r"mamba num_heads \(6\) over 4 ranks: not divisible"),
        ({"n_groups": 3, "mamba_num_heads": 12}, 2, False,
         r"mamba n_groups \(3\) over 2 ranks: not divisible"),
        ({"intermediate_size": 250}, 4, False, r"intermediate_size \(250\) over 4 ranks"),
        (NEMOTRON_MOE | {"moe_intermediate_size": 33}, 2, False,
         r"moe_intermediate_size \(33\) over 2 ranks"),
        (NEMOTRON_MOE, 4, True,
         r"num_experts \(3\) over 4 ranks with enable_expert_parallel: every rank needs at least"),
        ({}, 2, True, "enable_expert_parallel: the model has no MoE layers"),
        (QWEN35, 8, False, r"linear_num_value_heads \(4\) over 8 ranks: not divisible"),
        (QWEN35 | {"linear_num_key_heads": 3, "linear_num_value_heads": 6}, 2, False,
         r"linear_num_key_heads \(3\) over 2 ranks: not divisible"),
        (QWEN35 | {"linear_num_value_heads": 6}, 4, False,
         r"linear_num_value_heads \(6\) over 4 ranks: not divisible"),
    ],
)  # fmt: skip
def test_an_unsplittable_shape_is_refused_at_config_time_naming_field_and_numbers(
    tmp_path, changes, tp, expert_parallel, message
):
    model = write_config(tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=message) as info:
        EngineConfig(model=model, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
    assert f"tensor_parallel_size={tp} cannot split this model" in str(info.value)
    assert not multiprocessing.active_children()  # refused before any rank started


def test_shapes_the_rules_can_split_are_accepted(tmp_path):
    model = write_config(tmp_path / "ok", **NEMOTRON_MOE)
    EngineConfig(model=model, tensor_parallel_size=2, enable_expert_parallel=True)  # 3 experts
    EngineConfig(model="tiny", tensor_parallel_size=4)  # 2 KV heads and 2 groups, replicated
    # 2 GDN key heads over 4 ranks: replicated, each to the ranks whose value heads read it.
    EngineConfig(model=write_config(tmp_path / "gdn", **QWEN35), tensor_parallel_size=4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"enable_expert_parallel": True}, "enable_expert_parallel needs tensor_parallel_size > 1"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend='uni' runs one rank",
        ),
        (
            {"tensor_parallel_size": 2, "role": "decode"},
            "rank actors do \\(distributed_executor_backend='ray'\\)",
        ),
    ],
)
def test_inconsistent_parallel_arguments_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**args)


def test_the_executor_defaults_to_uni_at_one_rank_and_mp_above():
    assert EngineConfig().executor_backend == "uni"
    assert EngineConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert EngineConfig(distributed_executor_backend="mp").executor_backend == "mp"
