"""config.json of the short-convolution families (LFM2, LFM2-MoE) -> HybridModelConfig."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.models.configs import config_error, parse

# ---- LFM2, LFM2-MoE ------------------------------------------------------------------------


def lfm2(model_type: str = "lfm2", **changes: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "norm_eps": 1e-5,
    } | changes


def test_an_lfm2_config_parses_to_short_convs_and_swiglu_ffns():
    config = parse(lfm2())
    assert config.layer_kinds == ("short_conv", "mlp", "attention", "mlp", "short_conv", "mlp")
    assert config.short_conv is not None and config.short_conv.conv_kernel == 3
    assert config.tie_word_embeddings  # LFM2's default
    (conv,) = config.recurrent_state.tensors  # type: ignore[union-attr]
    assert (conv.name, conv.role, conv.local_shape(2)) == ("conv", "conv", (32, 2))
    attention = config.attention
    assert attention is not None and attention.rope is not None
    assert (attention.rope.rotary_dim, attention.qk_norm_scope) == (16, "head")


@pytest.mark.parametrize(
    ("changes", "ffn"),
    [
        ({}, 256),  # 2/3 of 96 = 64, rounded up to block_multiple_of 256
        ({"block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5}, 96),  # 64 * 1.5
        ({"block_ffn_dim_multiplier": None, "block_ff_dim": 30, "intermediate_size": None}, 20),
        ({"block_auto_adjust_ff_dim": False}, 96),
    ],
)
def test_lfm2_ffn_size_is_derived_as_transformers_derives_it(changes, ffn):
    config = parse(lfm2(**changes))
    assert config.mlp is not None and config.mlp.intermediate_size == ffn


def test_lfm2_legacy_full_attn_idxs_and_tie_embedding():
    raw = lfm2(layer_types=None, full_attn_idxs=[0], tie_embedding=False)
    config = parse(raw)
    assert config.layer_kinds[::2] == ("attention", "short_conv", "short_conv")
    assert not config.tie_word_embeddings


def test_lfm2_moe_dense_layers_then_experts_with_a_bias():
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    config = parse(lfm2("lfm2_moe", num_dense_layers=1, **moe))
    assert config.layer_kinds[1::2] == ("mlp", "moe", "moe")
    assert config.mlp is not None and config.mlp.intermediate_size == 96  # as given
    assert config.moe is not None and config.moe.score_bias and config.moe.topk_norm_eps == 1e-6


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (lfm2(num_hidden_layers=4), "layer_types", "lists 3 layers but num_hidden_layers is 4"),
        (lfm2(layer_types=None, full_attn_idxs=[3]), "full_attn_idxs",
         "expected layer indices below 3, got [3]"),
        (lfm2(layer_types=["conv", "mamba", "conv"]), "layer_types",
         "unknown layer type 'mamba' at index 1 (known: conv, full_attention)"),
        (lfm2("lfm2_moe", num_experts=2, num_experts_per_tok=3, moe_intermediate_size=8),
         "num_experts_per_tok", "3 is more than num_experts=2"),
    ],
)  # fmt: skip
def test_a_bad_lfm2_config_is_refused_naming_the_field(raw, field, message):
    error = config_error(raw)
    assert error.field == field and message in str(error)
