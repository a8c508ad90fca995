"""config.json of the Mamba1 family (Jamba) -> HybridModelConfig."""

from __future__ import annotations

from typing import Any

import pytest

from hybridserve.workers.executors.parallel import check_tensor_parallel
from tests.workers.models.configs import config_error, parse


def jamba(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "jamba",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 0,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    } | changes


def test_a_jamba_config_parses_to_periodic_mamba1_attention_and_experts():
    config = parse(jamba())
    assert config.layer_kinds == (
        *("mamba1", "moe", "attention", "mlp"),
        *("mamba1", "moe", "attention", "mlp"),
    )
    mamba = config.mamba1
    assert mamba is not None
    # transformers' defaults: expand 2, d_state 16, d_conv 4, dt_rank ceil(hidden / 16)
    assert (mamba.intermediate_size, mamba.state_size, mamba.conv_kernel) == (128, 16, 4)
    assert (mamba.dt_rank, mamba.conv_bias, mamba.proj_bias) == (4, True, False)
    conv, ssm = config.recurrent_state.tensors  # type: ignore[union-attr]
    assert (conv.name, conv.local_shape(2)) == ("conv", (64, 3))
    assert (ssm.name, ssm.role, ssm.local_shape(2)) == ("ssm", "recurrent", (64, 16))
    assert config.attention is not None and config.attention.rope is None
    moe = config.moe
    assert moe is not None and (moe.router, moe.norm_topk_prob) == ("softmax_topk", False)


def test_one_expert_means_a_dense_mlp_and_an_explicit_dt_rank_is_kept():
    config = parse(jamba(num_experts=1, num_experts_per_tok=1, mamba_dt_rank=7))
    assert "moe" not in config.layer_kinds and config.moe is None
    assert config.mamba1 is not None and config.mamba1.dt_rank == 7


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (jamba(attn_layer_offset=2), "attn_layer_offset",
         "2 must be smaller than attn_layer_period=2"),
        (jamba(num_experts_per_tok=5), "num_experts_per_tok", "5 is more than num_experts=4"),
        (jamba(hidden_act="gelu"), "hidden_act", "Jamba's Mamba layers use silu, got 'gelu'"),
        (jamba(mamba_dt_rank="wide"), "mamba_dt_rank", "expected an integer, got 'wide'"),
    ],
)  # fmt: skip
def test_a_bad_jamba_config_is_refused_naming_the_field(raw, field, message):
    error = config_error(raw)
    assert error.field == field and message in str(error)


def test_tensor_parallelism_that_cannot_split_the_mamba_channels_is_refused():
    config = parse(jamba(hidden_size=60, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"mamba intermediate size .* \(120\) over 7 ranks"):
        check_tensor_parallel(config, 7)
