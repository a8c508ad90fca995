"""config.json of Kimi Linear (Kimi Delta Attention, latent attention, MoE) ->
HybridModelConfig."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.models.configs import config_error, parse


def kimi(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "kimi_linear",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_expert_group": 2,
        "topk_group": 1,
        "num_shared_experts": 2,
        "routed_scaling_factor": 2.5,
    } | changes


def test_a_kimi_linear_config_parses_to_kda_latent_attention_and_experts():
    config = parse(kimi())
    assert config.layer_kinds[::2] == ("gdn", "attention", "gdn", "attention")
    assert config.layer_kinds[1::2] == ("mlp", "moe", "moe", "moe")
    gdn, attention, moe = config.gdn, config.attention, config.moe
    assert gdn is not None and gdn.per_channel_decay
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim) == (4, 4, 16)
    # The cache holds one latent per token: c (32) | k_rope (8), one plane.
    assert attention is not None and attention.latent is not None
    assert (attention.num_kv_heads, attention.head_dim, config.kv_planes) == (1, 40, 1)
    assert attention.scale == pytest.approx(24**-0.5) and attention.rope is None
    assert moe is not None and (moe.router, moe.num_expert_groups, moe.topk_groups) == (
        "sigmoid_grouped",
        2,
        1,
    )
    assert moe.shared is not None and moe.shared.intermediate_size == 64  # 2 x 32
    assert moe.routed_scaling_factor == 2.5 and moe.score_bias


def test_the_checkpoints_linear_attn_config_numbers_layers_from_one():
    raw = kimi(
        layer_types=None,
        mlp_layer_types=None,
        first_k_dense_replace=2,
        linear_attn_config={
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 3,
        },
    )
    config = parse(raw)
    assert config.layer_kinds[::2] == ("gdn", "attention", "gdn", "attention")
    assert config.layer_kinds[1::2] == ("mlp", "mlp", "moe", "moe")
    assert config.gdn is not None
    assert (config.gdn.num_value_heads, config.gdn.key_head_dim, config.gdn.conv_kernel) == (
        2,
        32,
        3,
    )


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (kimi(layer_types=None, linear_attn_config={"full_attn_layers": [2], "kda_layers": [1]}),
         "linear_attn_config", "must number the layers 1 .. 4 once each"),
        (kimi(num_experts_per_token=9), "num_experts_per_token", "9 of 8 experts"),
        (kimi(hidden_act="gelu"), "hidden_act", "Kimi Linear's convs and FFNs use silu"),
        (kimi(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types",
         "unknown layer type 'moe' at index 1 (known: dense, sparse)"),
    ],
)  # fmt: skip
def test_a_bad_kimi_linear_config_is_refused_naming_the_field(raw, field, message):
    error = config_error(raw)
    assert error.field == field and message in str(error)


def test_an_fp8_kv_cache_is_refused_for_latent_attention(tmp_path):
    """The latent cache stays in the model's dtype: the engine says so at once."""
    from hybridserve.workers import LLM
    from tests.helpers import make_hf_model

    make_hf_model("kimi_linear").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for latent"):
        LLM(str(tmp_path), kv_cache_dtype="fp8")
