"""HF config.json normalisation: ConfigReader + the architecture adapters -> HybridModelConfig."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from hybridserve.workers.models.config import ConfigError, ConfigReader, HybridModelConfig
from hybridserve.workers.models.registry import get_adapter
from hybridserve.workers.models.tiny import TINY_CONFIG

FILE = "ckpt/config.json"

NEMOTRON_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 96,
}


def parse(raw: dict[str, Any]) -> HybridModelConfig:
    return get_adapter(raw.get("model_type"), FILE).parse_config(ConfigReader(raw, FILE))


def nemotron(**changes: Any) -> dict[str, Any]:
    raw = dict(TINY_CONFIG) | NEMOTRON_MOE | changes
    return {k: v for k, v in raw.items() if v is not _DROP}


_DROP: Any = object()


def bamba(**changes: Any) -> dict[str, Any]:
    from transformers import BambaConfig

    raw = BambaConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
    ).to_dict()
    return {k: v for k, v in (raw | changes).items() if v is not _DROP}


def granite(**changes: Any) -> dict[str, Any]:
    from transformers import GraniteMoeHybridConfig

    raw = GraniteMoeHybridConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        position_embedding_type=None,
        attention_multiplier=0.25,
    ).to_dict()
    return {k: v for k, v in (raw | changes).items() if v is not _DROP}


def config_error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return info.value


# ---- NemotronH ----------------------------------------------------------------------------


def test_tiny_config_parses_to_the_expected_model():
    config = parse(dict(TINY_CONFIG))
    assert config.architecture == "nemotron_h"
    assert config.layer_kinds == (
        "mamba2", "attention", "mlp", "mamba2", "attention", "mlp", "mamba2", "mlp"
    )  # fmt: skip
    assert (config.num_recurrent_layers, config.num_attention_layers) == (3, 2)
    assert config.mamba2.conv_dim == 8 * 32 + 2 * 2 * 32
    assert (config.attention.num_heads, config.attention.num_kv_heads) == (4, 2)
    assert config.attention.rope is None  # NemotronH attention has no positional encoding
    assert config.attention.scale == 32**-0.5
    assert config.mlp.activation == "relu2" and not config.mlp.gated
    assert config.eos_token_ids == (256, 258)
    assert config.moe is None  # MoE fields are present in no layer


def test_hybrid_override_pattern_maps_every_symbol():
    config = parse(nemotron(hybrid_override_pattern="M*-E"))
    assert config.layer_kinds == ("mamba2", "attention", "mlp", "moe")
    assert config.moe.num_experts == 4 and config.moe.router == "sigmoid_grouped"
    assert config.moe.shared.intermediate_size == 96


@pytest.mark.parametrize(
    ("names", "kinds"),
    [
        (["mamba", "attention", "mlp", "moe"], ("mamba2", "attention", "mlp", "moe")),
        (
            ["linear_attention", "full_attention", "mlp", "moe"],
            ("mamba2", "attention", "mlp", "moe"),
        ),
        (["mamba2", "full_attention", "mamba"], ("mamba2", "attention", "mamba2")),
    ],
)
@pytest.mark.parametrize("field", ["layers_block_type", "layer_types"])
def test_layer_type_lists_accept_current_and_legacy_names(field, names, kinds):
    raw = nemotron(hybrid_override_pattern=_DROP) | {field: names}
    assert parse(raw).layer_kinds == kinds


def test_a_layer_list_wins_over_the_pattern():
    raw = nemotron(hybrid_override_pattern="MMMM", layers_block_type=["mamba", "attention"])
    assert parse(raw).layer_kinds == ("mamba2", "attention")


def test_transformers_nemotron_h_config_round_trips():
    from transformers import NemotronHConfig

    hf = NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        hybrid_override_pattern="M*-E",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        n_routed_experts=4,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
    )
    raw = json.loads(hf.to_json_string())  # as it lands in config.json
    config = parse(raw)
    assert config.layer_kinds == ("mamba2", "attention", "mlp", "moe")
    assert (config.mamba2.dt_min, config.mamba2.dt_max) == (0.0, math.inf)
    assert config.mamba2.n_groups == 2 and config.mamba2.head_dim == 8


def test_unknown_pattern_symbol_names_file_field_and_symbol():
    error = config_error(nemotron(hybrid_override_pattern="M*X-"))
    assert (error.file, error.field) == (FILE, "hybrid_override_pattern")
    message = str(error)
    assert message.startswith("ckpt/config.json: field 'hybrid_override_pattern': ")
    assert "unknown layer symbol 'X' at position 2" in message
    assert "M = mamba" in message  # lists what is known


def test_unknown_layer_name_names_field_index_and_name():
    raw = nemotron(hybrid_override_pattern=_DROP, layers_block_type=["mamba", "conv"])
    message = str(config_error(raw))
    assert message.startswith("ckpt/config.json: field 'layers_block_type': ")
    assert "unknown layer type 'conv' at index 1" in message


def test_missing_layer_layout_is_named():
    message = str(config_error(nemotron(hybrid_override_pattern=_DROP)))
    assert "field 'layers_block_type': required but missing" in message


def test_missing_required_field_is_named():
    error = config_error(nemotron(hidden_size=_DROP))
    assert str(error) == "ckpt/config.json: field 'hidden_size': required but missing"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "128", "expected an integer, got '128'"),
        ("hidden_size", 128.0, "expected an integer, got 128.0"),
        ("hidden_size", True, "expected an integer, got True"),
        ("mamba_num_heads", 0, "must be >= 1, got 0"),
        ("use_conv_bias", "yes", "expected true or false, got 'yes'"),
        ("layer_norm_epsilon", "small", "expected a number, got 'small'"),
        ("layer_norm_epsilon", 0.0, "must be > 0, got 0.0"),
        ("mlp_hidden_act", "tanh", "unsupported activation 'tanh'"),
        ("eos_token_id", [1, "2"], "expected a token id or a list of token ids"),
        ("n_groups", 3, "3 groups do not divide mamba_num_heads=8"),
        ("num_key_value_heads", 3, "3 does not divide num_attention_heads=4"),
    ],
)
def test_wrong_values_name_the_field(field, value, message):
    error = config_error(nemotron(**{field: value}))
    assert error.field == field
    assert str(error).startswith(f"ckpt/config.json: field '{field}': ")
    assert message in str(error)


def test_legacy_mamba_aliases():
    raw = nemotron(
        n_groups=_DROP,
        conv_kernel=_DROP,
        chunk_size=_DROP,
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=32,
    )
    spec = parse(raw).mamba2
    assert (spec.n_groups, spec.conv_kernel, spec.chunk_size) == (4, 3, 32)


def test_current_names_win_over_legacy_aliases():
    spec = parse(nemotron(n_groups=2, mamba_n_groups=4)).mamba2
    assert spec.n_groups == 2


def test_an_alias_with_a_wrong_value_is_named_by_its_own_name():
    error = config_error(nemotron(conv_kernel=_DROP, mamba_d_conv=1))
    assert error.field == "mamba_d_conv"
    assert "must be >= 2, got 1" in str(error)


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),
        ([0.0, "Infinity"], (0.0, math.inf)),
        ([0.0, math.inf], (0.0, math.inf)),
        ([0.001, 0.1], (0.001, 0.1)),
        (None, (0.0, math.inf)),
    ],
)
def test_time_step_limit(value, limit):
    spec = parse(nemotron(time_step_limit=value)).mamba2
    assert (spec.dt_min, spec.dt_max) == limit


@pytest.mark.parametrize("value", [[0.1, 0.01], [0.0], "inf", [-1.0, 1.0], [0.0, "big"]])
def test_bad_time_step_limit_is_named(value):
    error = config_error(nemotron(time_step_limit=value))
    assert error.field == "time_step_limit"


def test_time_step_limit_alias_from_json_text():
    text = json.dumps(nemotron(time_step_limit=_DROP, mamba_dt_limit=[0.0, math.inf]))
    assert '"mamba_dt_limit": [0.0, Infinity]' in text  # what json writes for inf
    raw = json.loads(text)
    spec = parse(raw).mamba2
    assert (spec.dt_min, spec.dt_max) == (0.0, math.inf)


def test_moe_geometry_errors_are_named():
    error = config_error(nemotron(hybrid_override_pattern="ME", num_experts_per_tok=5))
    assert error.field == "num_experts_per_tok"
    assert "5 is more than the 4 routed experts" in str(error)
    error = config_error(nemotron(hybrid_override_pattern="ME", n_group=3))
    assert error.field == "n_group"


# ---- Bamba --------------------------------------------------------------------------------


def test_bamba_attention_indices_interleave_mixers_and_mlps():
    config = parse(bamba())
    assert config.architecture == "bamba"
    assert config.layer_kinds == (
        "mamba2", "mlp", "attention", "mlp", "mamba2", "mlp", "attention", "mlp"
    )  # fmt: skip
    assert config.mlp.gated and config.mlp.intermediate_size == 96
    assert config.attention.rope.rotary_dim == 8  # half of head_dim 16
    assert config.attention.rope.theta == 10000.0
    assert (config.mamba2.num_heads, config.mamba2.head_dim, config.mamba2.n_groups) == (8, 16, 2)


def test_bamba_without_attention_layers():
    config = parse(bamba(attn_layer_indices=None))
    assert config.layer_kinds == ("mamba2", "mlp") * 4
    assert config.attention is None


@pytest.mark.parametrize("indices", [[1, 4], [-1], "1,3"])
def test_bamba_bad_attention_index_is_named(indices):
    error = config_error(bamba(attn_layer_indices=indices))
    assert error.field == "attn_layer_indices"
    assert "expected layer indices in [0, 4)" in str(error)


def test_bamba_layer_types_must_match_num_hidden_layers():
    error = config_error(bamba(layer_types=["mamba", "attention"]))
    assert error.field == "layer_types"
    assert "lists 2 layers but num_hidden_layers is 4" in str(error)


def test_bamba_rejects_moe_layer_names():
    error = config_error(bamba(layer_types=["mamba", "moe", "mamba", "mamba"]))
    assert "unknown layer type 'moe' at index 1" in str(error)


def test_bamba_mamba_head_geometry_is_checked():
    error = config_error(bamba(mamba_d_head=8))
    assert error.field == "mamba_d_head"
    assert "mamba_n_heads (8) * mamba_d_head (8) must equal the Mamba inner size (128" in (
        str(error)
    )


# ---- GraniteMoeHybrid ---------------------------------------------------------------------


@pytest.mark.parametrize("names", [["mamba", "attention"], ["linear_attention", "full_attention"]])
def test_granite_layer_types_current_and_legacy(names):
    config = parse(granite(layer_types=names))
    assert config.architecture == "granitemoehybrid"
    assert config.layer_kinds == ("mamba2", "moe", "attention", "moe")
    assert config.moe.router == "softmax_topk" and config.moe.gated
    assert config.moe.shared.intermediate_size == 48
    assert config.mlp is None
    assert config.attention.scale == 0.25  # attention_multiplier


def test_granite_without_layer_types_is_all_mamba():
    config = parse(granite(layer_types=_DROP, num_hidden_layers=3))
    assert config.layer_kinds == ("mamba2", "moe") * 3
    assert config.attention is None


def test_granite_without_experts_is_a_dense_shared_mlp():
    config = parse(granite(num_local_experts=0))
    assert config.layer_kinds == ("mamba2", "mlp", "attention", "mlp")
    assert config.moe is None
    assert config.mlp.intermediate_size == 48 and config.mlp.gated


@pytest.mark.parametrize(
    ("position_embedding_type", "rotary_dim"), [("rope", 16), (None, None), ("nope", None)]
)
def test_granite_rope_only_with_position_embedding_type_rope(position_embedding_type, rotary_dim):
    config = parse(granite(position_embedding_type=position_embedding_type))
    rope = config.attention.rope
    assert (None if rope is None else rope.rotary_dim) == rotary_dim


def test_granite_unknown_position_embedding_is_named():
    error = config_error(granite(position_embedding_type="alibi"))
    assert error.field == "position_embedding_type"
    assert "expected null or 'rope', got 'alibi'" in str(error)


def test_granite_scales_are_read():
    config = parse(granite(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8))
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_divisor) == (
        12.0,
        0.22,
        8.0,
    )


# ---- registry -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", None, 3])
def test_unsupported_model_type_lists_the_supported_ones(model_type):
    raw = dict(TINY_CONFIG) | {"model_type": model_type}
    error = config_error(raw)
    assert error.field == "model_type"
    assert str(error) == (
        f"ckpt/config.json: field 'model_type': unsupported model type {model_type!r} "
        "(supported: bamba, falcon_h1, granitemoehybrid, lfm2, lfm2_moe, nemotron_h, olmo_hybrid, "
        "qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_next)"
    )


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


# ---- Falcon-H1 -----------------------------------------------------------------------------


def falcon(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "falcon_h1",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "mamba_n_heads": 8,
        "mamba_d_ssm": 64,
        "mamba_d_head": "auto",
        "mamba_n_groups": 2,
        "mamba_d_state": 16,
    } | changes


def test_a_falcon_h1_config_parses_to_parallel_mixers_and_folded_multipliers():
    config = parse(falcon(lm_head_multiplier=0.5, ssm_multipliers=[1, 2, 3, 4, 5]))
    assert config.layer_kinds == ("mamba2", "attention", "mlp") * 2
    assert config.parallel_layer_ids == (1, 4)  # each attention reads its Mamba2's input
    assert config.logits_divisor == 2.0
    assert config.mamba2 is not None and config.mamba2.head_dim == 8
    assert config.mamba2.gate == "no_norm"
    assert config.weight_multipliers["ssm_dt"] == 5.0


@pytest.mark.parametrize(
    ("changes", "gate"),
    [
        ({"mamba_rms_norm": True}, "norm_before_gate"),
        ({"mamba_rms_norm": True, "mamba_norm_before_gate": False}, "norm_after_gate"),
    ],
)
def test_falcon_h1_mamba_gate_follows_the_config(changes, gate):
    config = parse(falcon(**changes))
    assert config.mamba2 is not None and config.mamba2.gate == gate


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"mamba_d_head": 10}, "mamba_d_head",
         "mamba_n_heads (8) * mamba_d_head (10) must equal the Mamba inner size (64"),
        ({"mamba_proj_bias": True}, "projectors_bias", "must equal mamba_proj_bias"),
        ({"ssm_multipliers": [1, 2]}, "ssm_multipliers", "expected 5 numbers, got [1, 2]"),
        ({"mlp_multipliers": [1, "x"]}, "mlp_multipliers", "expected a number, got 'x'"),
        ({"lm_head_multiplier": 0}, "lm_head_multiplier", "must be > 0"),
        ({"hidden_act": "gelu"}, "hidden_act", "must be silu (the MLP and the Mamba conv)"),
    ],
)  # fmt: skip
def test_a_bad_falcon_h1_config_is_refused_naming_the_field(changes, field, message):
    error = config_error(falcon(**changes))
    assert error.field == field and message in str(error)
