"""config.json of the Gated DeltaNet families (Qwen3-Next, Qwen3.5, OLMo-Hybrid) parsed."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.models.configs import config_error, parse

# ---- Gated DeltaNet (Qwen3-Next, Qwen3.5) -------------------------------------------------


def qwen(model_type: str = "qwen3_5_text", **changes: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 12,
        "linear_value_head_dim": 10,
        "rms_norm_eps": 1e-6,
    } | changes


def test_a_qwen3_5_config_parses_to_gdn_and_gated_attention_sublayers():
    config = parse(qwen())
    # No layer_types: every fourth layer is full attention (full_attention_interval 4).
    assert config.layer_kinds == ("gdn", "mlp") * 3 + ("attention", "mlp")
    assert config.zero_centred_norms and config.recurrent_kind == "gdn"
    assert config.attention is not None and config.attention.output_gate
    assert config.attention.qk_norm_eps == 1e-6
    assert config.attention.rope is not None and config.attention.rope.rotary_dim == 4  # 0.25
    gdn = config.gdn
    assert gdn is not None and (gdn.key_dim, gdn.value_dim, gdn.conv_dim) == (24, 60, 108)
    conv, recurrent = config.recurrent_state.tensors  # type: ignore[union-attr]
    assert [(s.size, s.units) for s in conv.sections] == [(24, 2), (24, 2), (60, 6)]
    assert conv.local_shape(2) == (12 + 12 + 30, 3) and recurrent.local_shape(2) == (3, 12, 10)
    assert conv.role == "conv" and recurrent.role == "recurrent"


def test_qwen3_next_moe_layers_follow_sparse_step_and_mlp_only_layers():
    raw = qwen(
        "qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    )
    config = parse(raw)
    assert config.layer_kinds[1::2] == ("mlp", "moe", "mlp", "mlp")
    assert config.moe is not None and config.moe.shared_gate and not config.moe.norm_topk_prob


def test_an_image_text_checkpoint_is_read_through_its_text_config():
    raw = {"model_type": "qwen3_5", "text_config": qwen(), "vision_config": {"depth": 1}}
    assert parse(raw).layer_kinds == parse(qwen()).layer_kinds
    error = config_error({"model_type": "qwen3_5_moe"})
    assert error.field == "text_config" and "expected an object, got None" in str(error)


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
         "layer_types",
         "unknown layer type 'mamba' at index 1 (known: full_attention, linear_attention)"),
        ({"linear_num_value_heads": 5}, "linear_num_value_heads",
         "5 is not a multiple of linear_num_key_heads=2"),
        ({"hidden_act": "gelu"}, "hidden_act", "must be silu for these models, got 'gelu'"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types",
         "lists 3 layers but num_hidden_layers is 4"),
    ],
)  # fmt: skip
def test_a_bad_qwen_config_is_refused_naming_the_field(changes, field, message):
    error = config_error(qwen(**changes))
    assert error.field == field and message in str(error)


# ---- OLMo-Hybrid ---------------------------------------------------------------------------


def olmo(**changes: Any) -> dict[str, Any]:
    layers = ["linear_attention", "full_attention", "linear_attention"]
    return qwen("olmo_hybrid", num_hidden_layers=3, layer_types=layers) | changes


def test_an_olmo_hybrid_config_parses_to_post_norm_attention_and_a_doubled_beta():
    config = parse(olmo(rope_parameters={"rope_type": "default", "rope_theta": None}))
    assert config.layer_kinds == ("gdn", "mlp", "attention", "mlp", "gdn", "mlp")
    assert config.post_norm_layer_ids == (2, 3)  # the attention layer's two sublayers
    attention = config.attention
    assert attention is not None and attention.rope is None and not attention.output_gate
    assert (attention.qk_norm_eps, attention.qk_norm_scope) == (1e-6, "all_heads")
    assert config.gdn is not None and (config.gdn.beta_scale, config.gdn.norm_eps) == (2.0, 1e-5)
    assert not config.zero_centred_norms


@pytest.mark.parametrize(
    ("changes", "rotary_dim", "beta_scale"),
    [
        ({}, 16, 2.0),  # no rope_parameters: transformers' default RoPE, over the whole head
        ({"rope_parameters": {"rope_theta": 5e5}, "linear_allow_neg_eigval": False}, 16, 1.0),
    ],
)
def test_olmo_hybrid_rope_and_beta_follow_the_config(changes, rotary_dim, beta_scale):
    config = parse(olmo(**changes))
    assert config.attention is not None and config.attention.rope is not None
    assert config.attention.rope.rotary_dim == rotary_dim
    assert config.gdn is not None and config.gdn.beta_scale == beta_scale


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"linear_num_value_heads": 5}, "linear_num_value_heads",
         "5 is not a multiple of linear_num_key_heads=2"),
        ({"hidden_act": "gelu"}, "hidden_act", "must be silu (the MLP and the DeltaNet conv)"),
        ({"num_hidden_layers": 4}, "layer_types", "lists 3 layers but num_hidden_layers is 4"),
        ({"layer_types": None}, "layer_types", "expected a non-empty list of layer types"),
        ({"linear_allow_neg_eigval": "yes"}, "linear_allow_neg_eigval",
         "expected true or false"),
    ],
)  # fmt: skip
def test_a_bad_olmo_hybrid_config_is_refused_naming_the_field(changes, field, message):
    error = config_error(olmo(**changes))
    assert error.field == field and message in str(error)
